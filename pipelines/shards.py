"""The shard writer: engine-neutral, runs inside Spark or Dask tasks.

The engine delivers transformed rows tagged with `_split` and `_shard`, every
row of one (split, shard) in the same partition. The writer sorts each group by
key (so a shard's bytes do not depend on the engine or partitioning) and writes
it with pyarrow under a deterministic name: a retried task rewrites the same file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

SPLIT_COL = "_split"
SHARD_COL = "_shard"

SHARD_META_SCHEMA = pa.schema(
    [
        ("split", pa.string()),
        ("shard", pa.int32()),
        ("path", pa.string()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("row_groups", pa.int32()),
        ("sha256", pa.string()),
    ]
)


def shard_relpath(version_dir_name: str, split: str, shard: int) -> str:
    return f"{version_dir_name}/{split}/shard-{shard:05d}.parquet"


def write_shard_groups(
    batches: Iterable[pa.RecordBatch],
    dataset_dir: str,
    version_dir_name: str,
    key: str,
    rows_per_row_group: int,
) -> Iterator[pa.RecordBatch]:
    """Write every (split, shard) group found in `batches`; yield one metadata row each."""
    batches = [b for b in batches if b.num_rows]
    if not batches:
        return
    table = pa.Table.from_batches(batches)
    groups = table.group_by([SPLIT_COL, SHARD_COL]).aggregate([])
    for split, shard in zip(
        groups.column(SPLIT_COL).to_pylist(), groups.column(SHARD_COL).to_pylist()
    ):
        mask = pc.and_(
            pc.equal(table.column(SPLIT_COL), split), pc.equal(table.column(SHARD_COL), shard)
        )
        part = table.filter(mask).drop_columns([SPLIT_COL, SHARD_COL])
        part = part.sort_by([(key, "ascending")])
        rel = shard_relpath(version_dir_name, split, int(shard))
        meta = _write_one(part, Path(dataset_dir) / rel, rows_per_row_group)
        yield pa.RecordBatch.from_pylist(
            [{"split": split, "shard": int(shard), "path": rel, **meta}],
            schema=SHARD_META_SCHEMA,
        )


def _write_one(table: pa.Table, path: Path, rows_per_row_group: int) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp, row_group_size=rows_per_row_group, compression="snappy")
    digest = hashlib.sha256()
    with open(tmp, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {
        "rows": table.num_rows,
        "bytes": path.stat().st_size,
        "row_groups": pq.ParquetFile(path).num_row_groups,
        "sha256": digest.hexdigest(),
    }
