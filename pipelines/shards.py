"""The shard writer: engine-neutral, runs inside Spark or Dask tasks.

The engine delivers parsed rows tagged with `_split` and `_shard`, every row of
one (split, shard) in the same partition. The writer applies the feature
transform, sorts each group by key (so a shard's bytes do not depend on the
engine or partitioning) and writes it through `pipelines.storage` under a
deterministic name: a retried task rewrites the same file, which appears whole
(one upload of the finished object; locally a rename) or not at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import storage
from .config import FeatureSpec
from .manifest import FittedStatistics
from .rows import SHARD_COL, SPLIT_COL
from .transform import model_table

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
    table: pa.Table,
    dataset_dir: str,
    version_dir_name: str,
    spec: FeatureSpec,
    stats: FittedStatistics,
    rows_per_row_group: int,
    shard_offsets: dict[str, int],
) -> Iterator[pa.RecordBatch]:
    """Write every (split, shard) group of `table`; yield one metadata row each.

    `shard_offsets` numbers an append's new shards after the existing ones.
    """
    if not table.num_rows:
        return
    groups = table.group_by([SPLIT_COL, SHARD_COL]).aggregate([])
    for split, shard in zip(
        groups.column(SPLIT_COL).to_pylist(), groups.column(SHARD_COL).to_pylist()
    ):
        mask = pc.and_(
            pc.equal(table.column(SPLIT_COL), split), pc.equal(table.column(SHARD_COL), shard)
        )
        part = table.filter(mask).sort_by([(spec.key, "ascending")])
        part = model_table(part, spec, stats, impute=spec.on_invalid_features == "impute")
        shard = int(shard) + shard_offsets.get(split, 0)
        rel = shard_relpath(version_dir_name, split, shard)
        meta = _write_one(part, storage.join(dataset_dir, rel), rows_per_row_group)
        yield pa.RecordBatch.from_pylist(
            [{"split": split, "shard": shard, "path": rel, **meta}],
            schema=SHARD_META_SCHEMA,
        )


def _write_one(table: pa.Table, url: str, rows_per_row_group: int) -> dict:
    # Encoded in memory (a shard is bounded by target_shard_bytes, and smaller than the
    # table it comes from), so its checksum and footer need no second read.
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, row_group_size=rows_per_row_group, compression="snappy")
    data = buf.getvalue()
    storage.write_bytes(url, data)
    return {
        "rows": table.num_rows,
        "bytes": data.size,
        "row_groups": pq.ParquetFile(pa.BufferReader(data)).num_row_groups,
        "sha256": hashlib.sha256(data).hexdigest(),
    }
