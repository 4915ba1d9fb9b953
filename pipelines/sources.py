"""Raw inputs: resolve a path, directory, glob or URL to files; refuse unreadable ones early.

Listing and opening go through `foundation.storage`, so a source on s3:// (or gs://,
abfs://, hdfs://) is read the same way as a local one, on the driver and in tasks.
"""

from __future__ import annotations

import importlib
import re
from contextlib import ExitStack

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.foundation import storage
from .config import SourceConfig
from shardline.foundation.errors import DataError

# Imported inside the functions that use them: pandas (~0.7 s: only where a DataFrame is built).

SUFFIXES = {
    "parquet": (".parquet", ".parq", ".pq"),
    "synthetic": (".parquet",),
    "csv": (".csv", ".csv.gz", ".tsv"),
    "json": (".json", ".jsonl", ".ndjson", ".json.gz", ".jsonl.gz"),
    "images": (".png", ".jpg", ".jpeg"),
}


def list_files(source: SourceConfig) -> list[str]:
    """Input files as full URLs (file:// for local ones), sorted; hidden and `_`-prefixed
    files are skipped."""
    url = source.path if "://" in source.path else storage.resolve(source.path, "pipelines.source.path")
    if source.format == "images":
        from .images import class_files

        if not storage.is_dir(url):
            raise DataError(f"{source.path}: images folder not found")
        return [f if "://" in f else f"file://{f}" for f in class_files(url, source.path)]
    cut = min((url.index(ch) for ch in "*?[" if ch in url), default=-1)
    if cut >= 0:
        base = url[: url.rindex("/", 0, cut)]
        pattern = _glob_regex(url[len(base) + 1 :])
        found = [f for f in storage.find_files(base) if pattern.fullmatch(f[len(base) + 1 :])]
    elif storage.is_dir(url):
        found = [
            f
            for f in storage.find_files(url)
            if f.lower().endswith(SUFFIXES[source.format])
            and not any(part.startswith(("_", ".")) for part in f[len(url) :].split("/"))
        ]
        if not found:
            raise DataError(f"{source.path}: no {source.format} files in this directory")
    elif storage.is_file(url):
        found = [url]
    else:
        raise DataError(f"{source.path}: input not found")
    if not found:
        raise DataError(f"{source.path}: input not found")
    return [f if "://" in f else f"file://{f}" for f in sorted(found)]


_PY_CODECS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}


def open_raw(url: str):
    """A raw input file opened for reading (binary, seekable), anywhere it lives: the one
    place tasks open raw files, through `foundation.storage`. Compressed files (.gz, .bz2,
    .xz; .zst, .lz4 as a forward-only stream) are decompressed."""
    ext = "." + url.rsplit(".", 1)[-1].lower() if "." in url.rsplit("/", 1)[-1] else ""
    if ext in _PY_CODECS:
        return importlib.import_module(_PY_CODECS[ext]).open(storage.open_input(url), "rb")
    return storage.open_stream(url)


def display(url: str) -> str:
    """A path as the user wrote it: local files without file://."""
    return storage.display(url)


def _glob_regex(pattern: str) -> re.Pattern:
    """A glob as a regex over paths: `*` and `?` stay within one directory, `**` crosses them."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out, i = out + re.escape("["), i + 1
            else:
                out, i = out + "[" + pattern[i + 1 : j].replace("!", "^", 1) + "]", j + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def write_raw_part(batches, raw_dir: str, index: int) -> int:
    """One partition of a DataFrame (the estimators' fit input, its Arrow batches) as
    `raw_dir/part-NNNNN.parquet`, through storage: any store; a retried task rewrites the
    same name. Rows written; an empty partition writes nothing."""
    rows, writer = 0, None
    with ExitStack() as stack:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if writer is None:
                f = stack.enter_context(storage.write(storage.join(raw_dir, f"part-{index:05d}.parquet")))
                writer = stack.enter_context(pq.ParquetWriter(f, batch.schema))
            writer.write_batch(batch)
            rows += batch.num_rows
    return rows


def with_row_key(part, name: str, partition_info=None):
    """A pandas partition with an int64 key column `name`: unique over partitions (up to
    2**32 rows each) and stable for the DataFrame's partitioning (Dask passes partition_info)."""
    number = (partition_info or {}).get("number", 0)
    return part.assign(**{name: (np.int64(number) << 32) + np.arange(len(part), dtype=np.int64)})


def write_pandas_part(part, raw_dir: str, partition_info=None):
    """write_raw_part of a pandas partition (Dask's map_partitions); its rows, as a Series."""
    import pandas as pd

    table = pa.Table.from_pandas(part, preserve_index=False)
    rows = write_raw_part(table.to_batches(), raw_dir, (partition_info or {}).get("number", 0))
    return pd.Series([rows], name="rows", dtype="int64")
