"""Prepare on Dask: futures for per-unit tasks, a dataframe P2P shuffle for the rows.

Everything runs on the workers; the client receives only per-unit reports and
shard metadata, so its memory does not grow with the data.
"""

from __future__ import annotations

import dask.dataframe as dd
import pandas as pd
import pyarrow as pa

from shardline.pipelines.sources import write_pandas_part
from shardline.pipelines.tasks import PART_COL


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    # Binary columns stay Arrow-backed: one buffer, not a Python bytes object per row.
    return table.to_pandas(types_mapper={pa.binary(): pd.ArrowDtype(pa.binary())}.get)


def _read_frame(source, read) -> pd.DataFrame:
    return _to_pandas(pa.concat_tables(list(read(source))))


def _write_frame(df: pd.DataFrame, write, out_schema: pa.Schema) -> pd.DataFrame:
    table = pa.Table.from_pandas(df.reset_index(), preserve_index=False)
    batches = list(write(table)) if len(df) else []
    # Arrow-backed columns: nullable int64 stays exact (numpy would make it float).
    return pa.Table.from_batches(batches, out_schema).to_pandas(types_mapper=pd.ArrowDtype)


def shuffle_write(sources: list, read, schema: pa.Schema, parts: int, write, out_schema: pa.Schema) -> list[dict]:
    """read(source) -> Arrow tables of `schema` with PART_COL in [0, parts), a task per
    source; each part's rows meet in one partition, where write(table) yields record
    batches of `out_schema`; those come back as dicts."""
    frame = dd.from_map(
        _read_frame, sources, read=read, meta=_to_pandas(schema.empty_table()), enforce_metadata=False
    )
    # Divisions 0, 1, ..., parts put part p alone in partition p, with no pass to
    # find them (a hash shuffle on the part number would pair some parts up).
    routed = frame.set_index(PART_COL, divisions=list(range(parts + 1)))
    out = routed.map_partitions(
        _write_frame, write, out_schema, meta=out_schema.empty_table().to_pandas(types_mapper=pd.ArrowDtype)
    )
    return pa.Table.from_pandas(out.compute(), preserve_index=False).to_pylist()


def stage_frame(df, folder: str) -> int:
    """Each partition of `df` as `folder/part-NNNNN.parquet`, written by its own task."""
    return int(df.map_partitions(write_pandas_part, folder, meta=("rows", "int64")).compute().sum())
