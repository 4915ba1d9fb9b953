"""A DataFrame as prepare's input: a Spark catalog table, a Spark SQL query's result
(`format = "table"`), or a Spark or Dask DataFrame given to `shardline.prepare(source=df)`.

The DataFrame is written once as Parquet into the dataset's `_staging/` folder, one file
per partition, by the engine's own tasks (rows never come to the driver), and that
snapshot is prepared as a Parquet source; the folder is removed when the prepare ends,
committed or not. Staging fixes what is read: a query or a table read twice (prepare's
two passes) could change in between; its files cannot. The manifest records the table
or the query text, not the staged files.
"""

from __future__ import annotations

import re
import uuid

from shardline.foundation import report, storage
from .config import PipelineConfig, SourceConfig
from shardline.foundation.errors import ConfigError, first_line

STAGING = "_staging"


def is_spark_frame(df) -> bool:
    return hasattr(df, "sparkSession") and hasattr(df, "mapInArrow")


def is_dask_frame(df) -> bool:
    return hasattr(df, "map_partitions") and hasattr(df, "npartitions")


def engine_of(df) -> str:
    """'spark' or 'dask' for a DataFrame prepare can take; ConfigError for anything else."""
    if is_spark_frame(df):
        return "spark"
    if is_dask_frame(df):
        return "dask"
    raise ConfigError(f"source: a Spark or Dask DataFrame is needed, not {type(df).__name__} "
                      "(a pandas DataFrame: dask.dataframe.from_pandas(df, npartitions=N))")


def describe(src: SourceConfig, frame) -> tuple[str, dict]:
    """How messages name the input, and the manifest's record of it."""
    if frame is not None:
        return "the DataFrame given to prepare", {"format": "dataframe", "engine": engine_of(frame)}
    if src.table is not None:
        return f"Spark table {src.table}", {"format": "table", "table": src.table}
    return "pipelines.source.query", {"format": "table", "query": src.query}


def table_frame(spark, src: SourceConfig):
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


def columns_of(df) -> list[str]:
    return [str(c) for c in df.columns]


def check_columns(cfg: PipelineConfig, names: list[str], where: str, append: bool = False) -> None:
    """The columns the config names are the DataFrame's: one line naming the input. (An
    append takes the settings it leaves out from the dataset.)"""
    f = cfg.features
    named = [f.label, *(f.numeric or []), *(f.categorical or []), *f.vectors, *f.tensors, *f.images]
    if not f.generate_key:
        named.insert(0, f.key)
    for setting, col in (("key", f.key if not f.generate_key else ""), ("label", f.label)):
        if col is None and not append and f.task != "next_token":
            raise ConfigError(f"pipelines.features.{setting} is not set: name the {setting} column "
                              f"(columns of {where}: {', '.join(names)})")
    for col in named:
        if col and col not in names:
            raise ConfigError(f"{where}: column '{col}' not found (its columns: {', '.join(names)})")


def stage(df, folder: str) -> int:
    """Each partition of `df` as `folder/part-NNNNN.parquet`, written in the engine's tasks."""
    if is_spark_frame(df):
        def write(batches):
            import pyarrow as pa
            from pyspark import TaskContext

            from shardline.pipelines.sources import write_raw_part

            rows = write_raw_part(batches, folder, TaskContext.get().partitionId())
            yield pa.RecordBatch.from_pydict({"rows": [rows]})

        return sum(r["rows"] for r in df.mapInArrow(write, "rows long").collect())
    from .sources import write_pandas_part

    return int(df.map_partitions(write_pandas_part, folder, meta=("rows", "int64")).compute().sum())


def prepare_frame(engine, cfg: PipelineConfig, frame, append: bool, refit: bool, by_plan: bool, lease):
    """Stage the input as Parquet, check it as a Parquet source, prepare it, then remove the
    staged files. The dataset's lease is held already."""
    from .checks import check_prepare
    from .prepare import prepare

    src = cfg.source
    where, record = describe(src, frame)
    if frame is None:
        spark = getattr(engine, "spark", None)
        if spark is None:
            raise ConfigError(f"pipelines.source.format = 'table' needs the Spark engine, not {engine.name}")
        frame = table_frame(spark, src)
    elif engine_of(frame) != engine.name:
        raise ConfigError(f"source: a {engine_of(frame)} DataFrame cannot be prepared on {engine.name} "
                          f"(pipelines.engine = '{engine.name}')")
    check_columns(cfg, columns_of(frame), where, append)
    root = storage.resolve(cfg.dataset_dir, "pipelines.dataset_dir")
    staging = storage.join(root, STAGING)
    storage.delete_tree(staging)  # a killed prepare's leftovers: we hold the dataset's lease
    folder = storage.join(staging, uuid.uuid4().hex[:12])
    try:
        if stage(frame, folder) == 0:
            raise ConfigError(f"{where}: no rows")
        staged = cfg.model_copy(update={"source": SourceConfig(
            format="parquet", path=folder, on_bad_rows=src.on_bad_rows)})
        checked = check_prepare(staged, append, refit, by_plan)
        for note in checked.notes:
            report.note(re.sub(r"\(inferred from [^)]*\)", f"(inferred from {where})", note))
        checked.sources = [record]
        return prepare(engine, staged, append, refit, by_plan, checked=checked, lease=lease)
    finally:
        storage.delete_tree(staging)
