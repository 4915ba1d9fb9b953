"""The shard writer: engine-neutral, runs inside Spark or Dask tasks after the shuffle.

The engine delivers the rows of pass 2 (tasks.shuffle_rows), every row of one part
(split, shard) in the same partition. The writer sorts a part by key (so a shard's
bytes depend neither on the engine nor on the partitioning), finds keys seen twice,
and writes the shard through `foundation.storage` under a deterministic name: a
retried task rewrites the same file, which appears whole (one upload of the
finished object; locally a rename) or not at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import rejects
from shardline.foundation import storage
from .config import FeatureSpec
from .tasks import PART_COL, POS_COL, Parts, label_fields
from .tensors import row_bytes, tensor_array
from .transform import feature_width, features_column

SHARD_META_SCHEMA = pa.schema(
    [
        ("split", pa.string()),
        ("shard", pa.int32()),
        ("path", pa.string()),  # null: nothing written (a repeated key, or no new rows)
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("row_groups", pa.int32()),
        ("sha256", pa.string()),
        ("repeated", pa.int64()),  # rows dropped because their key came earlier
        ("repeat_key", pa.int64()),  # refusing: the repeat met first in unit and row order,
        ("repeat_pos", pa.int64()),  # its position,
        ("first_pos", pa.int64()),  # and the position of the key's first row
        ("error", pa.string()),  # a permanent failure (a full disk), returned, not retried
        ("rejects", pa.string()),  # dropped repeats: JSON [[key, position], ...] (pipelines.rejects)
    ]
)


def shard_relpath(version_dir_name: str, split: str, shard: int) -> str:
    return f"{version_dir_name}/{split}/shard-{shard:05d}.parquet"


def write_parts(
    table: pa.Table,
    parts: Parts,
    dataset_dir: str,
    version_dir_name: str,
    spec: FeatureSpec,
    rows_per_row_group: int,
    shard_offsets: dict[str, int],
    drop_repeats: bool,
) -> Iterator[pa.RecordBatch]:
    """Write the shard of every part in `table`; yield one metadata row each.

    A key seen twice (also against an existing dataset's keys: rows with a negative
    position) is dropped after its first row when `drop_repeats`, else nothing is
    written and the earliest repeat is reported. `shard_offsets` numbers an append's
    new shards after the existing ones.
    """
    if not table.num_rows:
        return
    all_parts = table.column(PART_COL).to_numpy()
    for part in np.unique(all_parts):
        rows = np.flatnonzero(all_parts == part)
        split, shard = parts.split_shard(int(part))
        shard += shard_offsets.get(split, 0)
        key = table.column(spec.key).take(rows).to_numpy()
        pos = table.column(POS_COL).take(rows).to_numpy()
        order = np.lexsort((pos, key))  # by key, then first seen first
        k, p = key[order], pos[order]
        repeat = np.zeros(len(k), bool)
        repeat[1:] = k[1:] == k[:-1]
        dropped = repeat & (p >= 0)
        meta = {"split": split, "shard": shard, "repeated": int(dropped.sum())}
        if repeat.any() and not drop_repeats:
            i = int(np.flatnonzero(repeat)[np.argmin(p[repeat])])
            first = int(np.searchsorted(k, k[i]))
            meta.update(repeat_key=int(k[i]), repeat_pos=int(p[i]), first_pos=int(p[first]))
            yield pa.RecordBatch.from_pylist([meta], schema=SHARD_META_SCHEMA)
            continue
        meta["rejects"] = rejects.repeat_rejects(k[dropped], p[dropped])
        new = order[~repeat & (p >= 0)]  # positions into `rows`, sorted by key
        if len(new):
            part_table = table.take(rows[new])
            rel = shard_relpath(version_dir_name, split, shard)
            shard_table = shard_columns(part_table, spec)
            meta.update(path=rel, **_write_one(shard_table, storage.join(dataset_dir, rel), rows_per_row_group, spec))
        yield pa.RecordBatch.from_pylist([meta], schema=SHARD_META_SCHEMA)


def shard_columns(part_table: pa.Table, spec: FeatureSpec) -> pa.Table:
    """A shard's columns: key, the tabular `features` (when the spec has any), each tensor
    column (fixed_size_binary, its stored dtype's bytes), each image column (binary, as
    encoded), label."""
    width = feature_width(spec)
    cols = {spec.key: part_table.column(spec.key)}
    if width or not spec.typed:
        cols["features"] = features_column(_feature_rows(part_table.column("features"), width))
    for c, t in spec.tensors.items():
        cols[c] = tensor_array(_feature_rows(part_table.column(c), row_bytes(t), np.uint8))
    for c in spec.images:
        cols[c] = part_table.column(c).cast(pa.binary())
    for name, label_type in label_fields(spec):  # next_token: none, its tokens are the target
        cols[name] = part_table.column(name).cast(label_type)
    return pa.table(cols).combine_chunks()  # one chunk: the file's bytes cannot depend on how rows arrived


def _feature_rows(col, width: int, dtype=np.float32) -> np.ndarray:
    """A binary column of fixed-size rows (tasks.shuffle_rows) as [rows, width] of `dtype`."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offset_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], offset_type)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2], np.uint8)[offsets[0] : offsets[-1]]
    return data.view(dtype).reshape(len(arr), width)


def _write_one(table: pa.Table, url: str, rows_per_row_group: int, spec: FeatureSpec) -> dict:
    # Encoded in memory (a shard is bounded by target_shard_bytes, and smaller than the
    # table it comes from), so its checksum and footer need no second read.
    buf = pa.BufferOutputStream()
    # Tensors and images rarely repeat: a dictionary of them is wasted work and bytes.
    plain = {*spec.tensors, *spec.images}
    dictionary = [c for c in table.column_names if c not in plain] if plain else True
    pq.write_table(table, buf, row_group_size=rows_per_row_group, compression="snappy", use_dictionary=dictionary)
    data = buf.getvalue()
    storage.write_bytes(url, data)
    return {
        "rows": table.num_rows,
        "bytes": data.size,
        "row_groups": pq.ParquetFile(pa.BufferReader(data)).num_row_groups,
        "sha256": hashlib.sha256(data).hexdigest(),
    }
