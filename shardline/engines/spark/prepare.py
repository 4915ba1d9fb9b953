"""Prepare on Spark: tasks over `spark.range`, a hash repartition, `mapInArrow`.

Only the DataFrame API (no SparkContext, no RDD), so it runs on Spark Connect too.
Rows cross between the JVM and Python as Arrow batches: once into the shuffle and
once out of it; parsing, statistics and the transform happen in Python (rows.py,
transform.py), as on Dask.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from shardline.foundation.errors import ConfigError
from shardline.pipelines.raw import first_line
from shardline.pipelines.sources import write_raw_part
from shardline.pipelines.tasks import PART_COL

# Imported inside the functions that use them: pyspark (only with a Spark session: Dask and local jobs never
# import it).

_SPARK_TYPES = {
    pa.int64(): "bigint",
    pa.int32(): "int",
    pa.float32(): "float",
    pa.float64(): "double",
    pa.string(): "string",
    pa.binary(): "binary",
    pa.list_(pa.float64()): "array<double>",
    pa.bool_(): "boolean",
}


def spark_ddl(schema: pa.Schema) -> str:
    return ", ".join(f"`{f.name}` {_SPARK_TYPES[f.type]}" for f in schema)


def _one_per_partition(spark, n: int):
    """Rows 0..n-1, one per partition: a task per item."""
    return spark.range(0, n, 1, numPartitions=max(n, 1))


def run_tasks(spark, fn, items: list) -> list:
    """fn(item) for every item, one task each; JSON-able results in item order."""

    def each(batches):
        for b in batches:
            for i in b.column(0).to_pylist():
                yield pa.RecordBatch.from_pydict({"i": [i], "out": [json.dumps(fn(items[i]))]})

    rows = _one_per_partition(spark, len(items)).mapInArrow(each, "i bigint, out string").collect()
    return [json.loads(r["out"]) for r in sorted(rows, key=lambda r: r["i"])]


def shuffle_write(spark, sources: list, read, schema: pa.Schema, parts: int, write, out_schema: pa.Schema) -> list[dict]:
    """read(source) -> Arrow tables of `schema` with PART_COL in [0, parts), a task per
    source; each part's rows meet in one partition, where write(table) yields record
    batches of `out_schema`; those come back as dicts."""
    route = spark_routes(parts)

    def mapper(batches):
        for b in batches:
            for i in b.column(0).to_pylist():
                for t in read(sources[i]):
                    j = t.schema.get_field_index(PART_COL)
                    t = t.set_column(j, PART_COL, pa.array(route[t.column(j).to_numpy()]))
                    yield from t.to_batches()

    def writer(batches):
        batches = [b for b in batches if b.num_rows]
        if batches:
            t = pa.Table.from_batches(batches)
            j = t.schema.get_field_index(PART_COL)
            yield from write(t.set_column(j, PART_COL, pa.array(t.column(j).to_numpy() % parts)))

    mapped = _one_per_partition(spark, len(sources)).mapInArrow(mapper, spark_ddl(schema))
    out = mapped.repartition(parts, PART_COL).mapInArrow(writer, spark_ddl(out_schema))
    return [r.asDict() for r in out.collect()]


def spark_routes(parts: int) -> np.ndarray:
    """Per part p, an int r with r % parts == p that Spark's hash partitioning sends to
    partition p: then every partition holds exactly one part (plain part numbers
    collide, leaving some tasks two shards to write and others none)."""
    routes = np.empty(parts, np.int32)
    for p in range(parts):
        r = p
        while spark_partition(r, parts) != p:
            r += parts
        routes[p] = r
    return routes


def spark_partition(value: int, partitions: int) -> int:
    """pmod(murmur3(value, seed 42), partitions): the partition `repartition(n, col)` picks
    for an int column (Spark's Murmur3_x86_32.hashInt; checked against Spark in tests)."""

    def mul(a: int, b: int) -> int:
        return (a * b) & 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    k1 = rotl(mul(value & 0xFFFFFFFF, 0xCC9E2D51), 15)
    h1 = rotl(42 ^ mul(k1, 0x1B873593), 13)
    h1 = (mul(h1, 5) + 0xE6546B64) & 0xFFFFFFFF
    h1 ^= 4
    h1 = mul(h1 ^ (h1 >> 16), 0x85EBCA6B)
    h1 = mul(h1 ^ (h1 >> 13), 0xC2B2AE35)
    h1 ^= h1 >> 16
    signed = h1 - (1 << 32) if h1 & 0x80000000 else h1
    return signed % partitions


def stage_frame(df, folder: str) -> int:
    """Each partition of `df` as `folder/part-NNNNN.parquet`, written in its own task."""

    def write(batches):
        from pyspark import TaskContext  # in the task: pyspark is there

        rows = write_raw_part(batches, folder, TaskContext.get().partitionId())
        yield pa.RecordBatch.from_pydict({"rows": [rows]})

    return sum(r["rows"] for r in df.mapInArrow(write, "rows long").collect())


def table_frame(spark, src):
    """The Spark DataFrame of a catalog table or a query, analysed now: a missing table or a
    query that does not parse is one line before any job runs."""
    try:
        df = spark.table(src.table) if src.table is not None else spark.sql(src.query)
        df.schema  # Connect analyses lazily: ask for the schema to be told now
    except Exception as e:
        what = f"pipelines.source.table = {src.table!r}" if src.table is not None else "pipelines.source.query"
        raise ConfigError(f"{what}: {_spark_problem(e)}") from None
    return df


def _spark_problem(e: Exception) -> str:
    name = type(e).__name__
    text = first_line(e)
    if "TABLE_OR_VIEW_NOT_FOUND" in text or "NoSuchTable" in name:
        return f"no such table or view ({text})"
    if "PARSE_SYNTAX_ERROR" in text or "ParseException" in name:
        return f"does not parse as Spark SQL ({text})"
    return text
