"""The shapes large data arrives in, for `shardline bench shapes` (kept like scale_data's):
many small CSV files; a skewed column and a dominant category; rows of one wide vector."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from .scale_data import quickstart_csv, quickstart_rows, raw_folder

SKEW_USERS = 1000  # distinct values of the skewed column; value u0 holds half the rows
DOMINANT = 0.9  # share of the dominant category
VECTOR_ROWS_PER_FILE = 16_384


def small_files(data_dir, files: int, rows_per_file: int, progress=print) -> Path:
    """`files` CSV files of `rows_per_file` quickstart rows (the same rows as
    many_rows_few_files(files * rows_per_file))."""
    spec = {"kind": "small-files", "files": files, "rows_per_file": rows_per_file}
    write = partial(_write_small, rows_per_file=rows_per_file)
    return raw_folder(data_dir, f"small-{files}x{rows_per_file}", spec, write, files, progress)


def _write_small(folder: str, i: int, rows_per_file: int) -> str:
    path = os.path.join(folder, f"part-{i:07d}.csv")
    pcsv.write_csv(quickstart_rows(i * rows_per_file, (i + 1) * rows_per_file), path)
    return path


def few_files(data_dir, rows: int, files: int, progress=print) -> Path:
    """The same rows in `files` files."""
    return quickstart_csv(data_dir, rows, progress, rows_per_file=-(-rows // files), name=f"few-{files}x{rows // files}")


def skewed(data_dir, rows: int, progress=print, rows_per_file: int = 1 << 20) -> Path:
    """Quickstart rows plus `user` (text; u0 in half the rows, the rest spread over
    SKEW_USERS values) and `color` made dominant (DOMINANT of the rows one level)."""
    files = -(-rows // rows_per_file)
    spec = {"kind": "skewed", "rows": rows, "rows_per_file": rows_per_file, "users": SKEW_USERS, "dominant": DOMINANT}
    write = partial(_write_skewed, rows=rows, rows_per_file=rows_per_file)
    return raw_folder(data_dir, f"skewed-{rows}", spec, write, files, progress)


def _write_skewed(folder: str, i: int, rows: int, rows_per_file: int) -> str:
    from shardline.pipelines.hashing import uniform

    start, stop = i * rows_per_file, min((i + 1) * rows_per_file, rows)
    path = os.path.join(folder, f"part-{i:06d}.csv")
    with pcsv.CSVWriter(path + ".tmp", _skewed_rows(0, 1).schema) as w:
        for a in range(start, stop, 100_000):
            w.write_table(_skewed_rows(a, min(a + 100_000, stop), uniform))
    os.replace(path + ".tmp", path)
    return path


def _skewed_rows(start: int, stop: int, uniform=None) -> pa.Table:
    if uniform is None:
        from shardline.pipelines.hashing import uniform
    t = quickstart_rows(start, stop)
    keys = np.arange(start, stop, dtype=np.int64)
    u = uniform(keys, 91)
    users = np.where(u < 0.5, 0, 1 + (uniform(keys, 92) * (SKEW_USERS - 1)).astype(np.int64))
    color = np.where(uniform(keys, 93) < DOMINANT, "red", t.column("color").to_numpy(zero_copy_only=False))
    t = t.set_column(t.schema.get_field_index("color"), "color", pa.array(color, pa.string()))
    return t.append_column("user", pa.array(np.char.add("u", users.astype(str)), pa.string()))


def vectors(data_dir, rows: int, width: int, progress=print) -> Path:
    """Parquet rows of key, label (3 classes) and `emb`, `width` float32 values a row."""
    files = -(-rows // VECTOR_ROWS_PER_FILE)
    spec = {"kind": "vectors", "rows": rows, "width": width, "rows_per_file": VECTOR_ROWS_PER_FILE}
    write = partial(_write_vectors, rows=rows, width=width)
    return raw_folder(data_dir, f"vectors-{rows}x{width}", spec, write, files, progress)


def _write_vectors(folder: str, i: int, rows: int, width: int) -> str:
    start, stop = i * VECTOR_ROWS_PER_FILE, min((i + 1) * VECTOR_ROWS_PER_FILE, rows)
    g = np.random.default_rng(i)
    n = stop - start
    emb = g.standard_normal((n, width), dtype=np.float32)
    label = (emb[:, :8].sum(1) > 0).astype(np.int64) + (emb[:, 8:16].sum(1) > 1)
    table = pa.table({
        "key": np.arange(start, stop, dtype=np.int64),
        "label": label,
        "emb": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), width).cast(pa.list_(pa.float32())),
    })
    path = os.path.join(folder, f"part-{i:06d}.parquet")
    pq.write_table(table, path + ".tmp", row_group_size=4096)
    os.replace(path + ".tmp", path)
    return path


def needed_bytes(rows: int, width: int) -> int:
    """Disk a vector run needs: the raw values (incompressible floats) and the shards."""
    return 2 * rows * width * 4
