"""The prepare engine on Spark: mapInPandas/mapInArrow over the shared row code."""

from __future__ import annotations

import json

import pyarrow as pa

from . import storage
from .config import PipelineConfig
from .rows import FILE_COL, HASH_COL, SHARD_COL, SPLIT_COL
from .shards import SHARD_META_SCHEMA
from .synthetic import part_urls, remove_stale_parts, write_generated

_SPARK_TYPES = {
    pa.int64(): "bigint",
    pa.int32(): "int",
    pa.float64(): "double",
    pa.string(): "string",
    pa.list_(pa.float64()): "array<double>",
    pa.bool_(): "boolean",
    pa.null(): "string",  # a column empty in the head of a file read in Python
}


def spark_ddl(schema: pa.Schema) -> str:
    return ", ".join(f"`{f.name}` {_SPARK_TYPES[f.type]}" for f in schema)


class SparkEngine:
    name = "spark"

    def __init__(self, spark):
        self.spark = spark
        self.version = spark.version

    def generate(self, cfg: PipelineConfig) -> None:
        # Python tasks write the files through storage: no Hadoop filesystem (s3a jars) needed.
        src, spec = cfg.source.synthetic, cfg.features
        out = storage.resolve(cfg.source.path, "pipelines.source.path")
        parts = part_urls(out, src)

        def each(batches):
            import pandas as pd

            for b in batches:
                for start, stop, url in zip(b["start"], b["stop"], b["url"]):
                    yield pd.DataFrame({"rows": [write_generated((start, stop), url, src, spec)]})

        rows = [(a, b, url) for (a, b), url in parts]
        ranges_df = self.spark.createDataFrame(rows, "start bigint, stop bigint, url string").repartition(len(rows))
        ranges_df.mapInPandas(each, "rows bigint").collect()
        remove_stale_parts(out, [url for _, url in parts])

    def read(self, files: list[str], cfg: PipelineConfig):
        from pyspark.sql import functions as F

        if any(storage.is_remote(f) for f in files):
            from .engine_dask import read_raw_file

            fmt, delim = cfg.source.format, cfg.source.csv_delimiter
            return self._read_in_python(files, lambda url, head=None: read_raw_file(url, fmt, delim, head))
        reader = self.spark.read
        fmt = cfg.source.format
        if fmt in ("parquet", "synthetic"):
            df = reader.parquet(*files)
        elif fmt == "csv":
            # Every column as text: the shared parser decides what parses.
            df = reader.options(header=True, sep=cfg.source.csv_delimiter, inferSchema=False).csv(files)
        else:
            df = reader.json(files, primitivesAsString=False)
        return df.withColumn(FILE_COL, F.input_file_name())

    def _read_in_python(self, files: list[str], read_one):
        """Files on an object store, read by Python tasks through storage (one file per
        partition), as Spark's readers cannot without Hadoop's connector jars.
        read_one(url, head=None) -> pandas with `_file`."""
        head = read_one(files[0], head=100)
        schema = pa.Schema.from_pandas(head, preserve_index=False)

        def each(batches):
            for b in batches:
                for url in b["url"]:
                    yield read_one(url)

        frame = self.spark.createDataFrame([(f,) for f in files], "url string").repartition(len(files))
        return frame.mapInPandas(each, spark_ddl(schema))

    def columns(self, frame) -> list[str]:
        return frame.columns

    def reports(self, frame, fn) -> list[dict]:
        def each(batches):
            import pandas as pd

            for b in batches:
                yield pd.DataFrame({"report": [json.dumps(fn(b))]})

        return [json.loads(r["report"]) for r in frame.mapInPandas(each, "report string").collect()]

    def parsed(self, frame, fn, schema):
        def each(batches):
            for b in batches:
                yield fn(b)

        # Not cached: Spark's in-memory cache of a whole partition ran the 1g driver
        # JVM (local mode hosts the executors) out of heap at 10M rows. Parsing again
        # for the write costs one more pass of Python over the rows.
        return frame.mapInPandas(each, spark_ddl(schema))

    def duplicate_key(self, parsed, key: str, existing: list[str]):
        from pyspark.sql import functions as F

        keys = parsed.select(key, FILE_COL)
        if existing:
            if any(storage.is_remote(f) for f in existing):
                from .engine_dask import _shard_keys

                old = self._read_in_python(existing, lambda url, head=None: _shard_keys(url, key))
            else:
                old = self.spark.read.parquet(*existing).select(key).withColumn(FILE_COL, F.input_file_name())
            keys = keys.unionByName(old)
        dup = keys.groupBy(key).count().where("count > 1").limit(1).collect()
        if not dup:
            return None
        k = dup[0][key]
        files = keys.where(F.col(key) == k).select(FILE_COL).distinct().collect()
        return k, sorted(r[FILE_COL] for r in files)

    def write(self, parsed, shards: dict[str, int], writer) -> list[dict]:
        from pyspark.sql import functions as F

        shard = F.lit(0)
        for split, n in shards.items():
            if n:
                shard = F.when(F.col(SPLIT_COL) == split, F.pmod(F.col(HASH_COL), F.lit(n))).otherwise(shard)

        def each(batches):
            batches = [b for b in batches if b.num_rows]
            if batches:
                yield from writer(pa.Table.from_batches(batches))

        tagged = parsed.withColumn(SHARD_COL, shard.cast("int"))
        out = tagged.repartition(sum(shards.values()), SPLIT_COL, SHARD_COL).mapInArrow(
            each, spark_ddl(SHARD_META_SCHEMA)
        )
        return [r.asDict() for r in out.collect()]
