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
from shardline.foundation.errors import ConfigError

# Imported inside the functions that use them: pipelines.checks (imports pandas); pipelines.prepare (imports
# pandas).

STAGING = "_staging"


def describe(src: SourceConfig, frame, engine: str) -> tuple[str, dict]:
    """How messages name the input, and the manifest's record of it (`engine`: the frame's)."""
    if frame is not None:
        return "the DataFrame given to prepare", {"format": "dataframe", "engine": engine}
    if src.table is not None:
        return f"Spark table {src.table}", {"format": "table", "table": src.table}
    return "pipelines.source.query", {"format": "table", "query": src.query}


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


def prepare_frame(engine, cfg: PipelineConfig, frame, append: bool, refit: bool, by_plan: bool, lease):
    """Stage the input as Parquet, check it as a Parquet source, prepare it, then remove the
    staged files. The dataset's lease is held already."""
    from .checks import check_prepare
    from .prepare import prepare

    src = cfg.source
    where, record = describe(src, frame, engine.name)
    if frame is None:
        frame = engine.table_frame(src)  # a catalog table or a query: engines with a Spark catalog
    elif not engine.owns_frame(frame):
        raise ConfigError(f"source: a {type(frame).__name__} cannot be prepared on {engine.name} "
                          f"(pipelines.engine = '{engine.name}')")
    check_columns(cfg, columns_of(frame), where, append)
    root = storage.resolve(cfg.dataset_dir, "pipelines.dataset_dir")
    staging = storage.join(root, STAGING)
    storage.delete_tree(staging)  # a killed prepare's leftovers: we hold the dataset's lease
    folder = storage.join(staging, uuid.uuid4().hex[:12])
    try:
        if engine.stage_frame(frame, folder) == 0:
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
