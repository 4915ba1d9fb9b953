"""Raw inputs: resolve a path, directory, glob or URL to files; refuse unreadable ones early."""

from __future__ import annotations

import fsspec
import pyarrow.parquet as pq

from .config import SourceConfig
from .errors import DataError

SUFFIXES = {
    "parquet": (".parquet", ".parq", ".pq"),
    "synthetic": (".parquet",),
    "csv": (".csv", ".csv.gz", ".tsv"),
    "json": (".json", ".jsonl", ".ndjson", ".json.gz", ".jsonl.gz"),
}


def list_files(source: SourceConfig) -> list[str]:
    """Input files as full URLs, sorted; hidden and `_`-prefixed files are skipped."""
    fs, path = fsspec.core.url_to_fs(source.path)
    if any(ch in path for ch in "*?["):
        found = fs.glob(path)
    elif fs.isdir(path):
        found = [
            p
            for p in fs.find(path)
            if p.lower().endswith(SUFFIXES[source.format])
            and not any(part.startswith(("_", ".")) for part in p[len(path) :].split("/"))
        ]
        if not found:
            raise DataError(f"{source.path}: no {source.format} files in this directory")
    elif fs.isfile(path):
        found = [path]
    else:
        raise DataError(f"{source.path}: input not found")
    if not found:
        raise DataError(f"{source.path}: input not found")
    return [fs.unstrip_protocol(p) for p in sorted(found)]


def open_raw(url: str):
    """A raw input file opened for reading (binary, seekable), anywhere it lives.

    The one place tasks open raw files: both engines read through it, so a new
    filesystem needs support here only. Compressed files (.gz, ...) are decompressed.
    """
    return fsspec.open(url, "rb", compression="infer").open()


def check_readable(files: list[str], fmt: str) -> None:
    """Parquet: every footer parses. Others: every file opens. Names the first bad file."""
    for url in files:
        try:
            with fsspec.open(url, "rb") as f:
                if fmt in ("parquet", "synthetic"):
                    pq.read_metadata(f)
                else:
                    f.read(1)
        except Exception as e:
            what = "not a readable Parquet file" if fmt in ("parquet", "synthetic") else "unreadable"
            raise DataError(f"{display(url)}: {what} ({_first_line(e)})") from None


def display(url: str) -> str:
    """A path as the user wrote it: local files without file://."""
    return url[len("file://") :] if url.startswith("file://") else url


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
