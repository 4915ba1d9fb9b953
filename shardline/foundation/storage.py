"""Every piece of state is a URL, resolved once on the driver and opened the same way everywhere.

A path setting is resolved where the config is composed (`resolve`): a URL
(`s3://`, `gs://`, `abfs://`, `hdfs://`, `file://`) stays as it is; a local path is
made absolute there, never in a task's working folder. Every task then opens it
through this module: reads and listings through `pyarrow.fs` (random access into
Parquet on object stores included), so Spark needs no Hadoop S3 jars.

The commit protocol, the same on every store: write the parts under fresh or
deterministic names (`write`: a local file goes to a temp name and is renamed; an
object store gets the finished object in one upload, never a partial one), then
publish with ONE create-only step (`create_only`), or replace a small control
object only if it did not change since it was read (`read_tagged` + `replace_if`;
leases are built on these, see `foundation.lease`). The conditional steps are
`foundation.commit`'s; how each store implements them is in `foundation.object_stores`
and docs/storage.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import uuid
from collections.abc import Iterator
from typing import IO

import pyarrow as pa
import pyarrow.fs

from . import failures, object_stores
from .errors import ConfigError, DataError, StorageError
from .redact import redact

REMOTE_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs")
_SCHEMES = ("file", *REMOTE_SCHEMES)
# Objects bigger than this are spooled to the task's temp folder before their one upload.
_SPOOL_BYTES = 16 * 2**20


# -- URLs -------------------------------------------------------------------------


def scheme(url: str) -> str:
    """'s3', 'gs', ... or 'file' for a local path."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep else "file"


def is_remote(url: str) -> bool:
    return scheme(url) != "file"


def local_path(url: str) -> str:
    """The path of a local URL (`file:///x` or `/x`)."""
    return url[len("file://") :] if url.startswith("file://") else url


def resolve(path: str, setting: str, cluster: str | None = None) -> str:
    """A path setting as every host will open it; call on the driver, before anything starts.

    cluster: a description of the non-local master/scheduler tasks run on (e.g.
    "spark.master = 'spark://h:7077'"), or None when every task runs on this machine.
    A relative local path is refused then: each host would resolve it in its own
    working folder, where the driver and the next attempt cannot find it.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{setting}: empty path")
    if "://" in path:
        s = scheme(path)
        if s in ("s3a", "s3n"):
            raise ConfigError(
                f"{setting} = {path!r}: use s3://{path.split('://', 1)[1]} (shardline reads "
                f"object stores itself, without Hadoop's S3A connector)"
            )
        if s not in _SCHEMES:
            raise ConfigError(
                f"{setting} = {path!r}: storage scheme '{s}' is not supported "
                f"(use a local path, file://, {', '.join(f'{x}://' for x in REMOTE_SCHEMES)})"
            )
        if s == "file":
            if not local_path(path).startswith("/"):
                raise ConfigError(f"{setting} = {path!r}: a file:// URL must be absolute (file:///...)")
            return path
        bucket = path.split("://", 1)[1].split("/", 1)[0]
        if not bucket:
            raise ConfigError(f"{setting} = {path!r}: the URL names no bucket or host")
        return path.rstrip("/")
    expanded = os.path.expanduser(path)
    if not os.path.isabs(expanded) and cluster:
        raise ConfigError(
            f"{setting} = {path!r} is a relative path, but {cluster} runs tasks on other hosts, "
            f"which would each resolve it in their own working folder; use a URL every host "
            f"can reach (s3://bucket/prefix, hdfs://namenode/path) or an absolute path on a "
            f"filesystem mounted on every host"
        )
    return os.path.normpath(os.path.abspath(expanded))


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/") or "/"
    for p in parts:
        out = f"{out.rstrip('/')}/{p.strip('/')}"
    return out


def name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def parent(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[0]


def display(url: str) -> str:
    """A URL as the user wrote it, for messages: local files without file://, a password,
    token or signature in it masked (foundation.redact). Not for opening: `local_path`."""
    return redact(local_path(url))


# -- the filesystem helper --------------------------------------------------------


def _pafs():
    return pyarrow.fs


def filesystem(url: str):
    """(pyarrow FileSystem, path inside it) for a URL or local path."""
    if not is_remote(url):
        return _pafs().LocalFileSystem(), os.path.abspath(local_path(url))
    return object_stores.filesystem(url)


def open_input(url: str):
    """A seekable pyarrow file: Parquet reads only the byte ranges it needs (footer, row groups)."""
    fs, path = filesystem(url)
    return fs.open_input_file(path)


_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}


def open_stream(url: str, compression: str | None = "detect"):
    """A sequential pyarrow stream; `.gz` and the like are decompressed (compression="detect").

    Built on the random-access file: pyarrow's own input stream on S3 read a whole
    object ~60x slower here (many small requests).
    """
    f = open_input(url)
    codec = _CODECS.get(os.path.splitext(url)[1].lower()) if compression == "detect" else compression
    return pa.CompressedInputStream(f, codec) if codec else f


def read_bytes(url: str) -> bytes:
    def read() -> bytes:
        with open_input(url) as f:
            return f.read()

    return failures.with_backoff(read) if is_remote(url) else read()


def file_info(url: str):
    """pyarrow's FileInfo: type, size, mtime (an object's last-modified time)."""
    fs, path = filesystem(url)
    return fs.get_file_info(path)


def exists(url: str) -> bool:
    return file_info(url).type != _pafs().FileType.NotFound


def is_file(url: str) -> bool:
    return file_info(url).type == _pafs().FileType.File


def is_dir(url: str) -> bool:
    """On object stores: a prefix that has objects under it."""
    return file_info(url).type == _pafs().FileType.Directory


def size(url: str) -> int:
    return file_info(url).size


def list_dir_info(url: str) -> list:
    """pyarrow FileInfos (base_name, type, size, mtime) of what is directly under `url`."""
    fs, path = filesystem(url)
    return fs.get_file_info(_pafs().FileSelector(path, allow_not_found=True))


def list_dir(url: str) -> list[str]:
    """Names directly under `url` (files and directories), sorted; [] if there is none."""
    return sorted(i.base_name for i in list_dir_info(url))


def find_files(url: str) -> list[str]:
    """Every file under `url`, recursively, as URLs in the form of `url`, sorted."""
    fs, path = filesystem(url)
    infos = fs.get_file_info(_pafs().FileSelector(path, recursive=True, allow_not_found=True))
    base = path.rstrip("/")
    return sorted(join(url, i.path[len(base) :]) for i in infos if i.type == _pafs().FileType.File)


def delete(url: str) -> None:
    """Remove a file; nothing if it is not there."""
    fs, path = filesystem(url)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(path)


def delete_tree(url: str) -> None:
    """Remove a directory (an object store prefix) and everything under it."""
    fs, path = filesystem(url)
    with contextlib.suppress(FileNotFoundError):
        if is_remote(url) and "/" not in path.strip("/"):
            fs.delete_dir_contents(path, missing_dir_ok=True)  # a bucket's root: keep the bucket
        else:
            fs.delete_dir(path)


def remove_empty_dir(url: str) -> None:
    """Remove a local directory if it is empty (object stores have no empty directories)."""
    if not is_remote(url):
        with contextlib.suppress(OSError):
            os.rmdir(local_path(url))


@contextlib.contextmanager
def write(url: str) -> Iterator[IO[bytes]]:
    """A binary file to write `url` through; it appears whole when the block ends, never
    partly, and not at all if the block raises. Overwrites: the name is the caller's
    (deterministic or fresh), publishing it is not a commit.
    """
    if not is_remote(url):
        path = local_path(url)
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, temp_name(os.path.basename(path)))
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(d)
        return

    def upload() -> None:
        spool.seek(0)
        object_stores.upload(url, spool)

    with tempfile.SpooledTemporaryFile(_SPOOL_BYTES) as spool:
        yield spool
        # A reset connection or a 503 is tried again (foundation.failures); no space, a
        # missing bucket or a refusal is raised at once.
        failures.with_backoff(upload)


def write_bytes(url: str, data: bytes) -> None:
    with write(url) as f:
        f.write(data)


def check_ours(url: str, ours, refusal: str) -> None:
    """Refuse an output `url` that is a file, or a directory holding a name `ours(name)`
    does not claim: we never write into, or later clean up, files we did not make.
    refusal: what to say, with {found} for the first foreign name. Reads only."""
    if is_file(url):
        raise DataError(f"{display(url)}: output path exists and is not a directory")
    foreign = [n for n in list_dir(url) if not ours(n)]
    if foreign:
        raise DataError(f"{display(url)}: {refusal.format(found=repr(foreign[0]))}")


def fsync_dir(path: str) -> None:
    """Make a rename in local directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the commit protocol's conditional steps ---------------------------------------


def temp_name(name: str) -> str:
    """A fresh temporary name beside `name` (the local commit steps write there first)."""
    return f".{name}.{uuid.uuid4().hex[:8]}.tmp"


def is_temp_of(entry: str, name: str) -> bool:
    """Whether `entry` is one of `temp_name(name)`'s names: a write of `name` that died
    before its rename (a SIGKILL), ours to ignore and remove."""
    return re.fullmatch(rf"\.{re.escape(name)}\.[0-9a-f]{{8}}\.tmp", entry) is not None


# -- checks before anything starts -----------------------------------------------------


def check_access(url: str, setting: str, write: bool = False) -> None:
    """Fail in one line, in seconds, if `url` cannot be read (or written): an unreachable
    endpoint, a missing bucket, missing or rejected credentials, access denied.
    Writes nothing, not even a probe object.
    """
    if is_remote(url):
        from . import object_stores

        object_stores.check_access(url, setting, write)
        return
    path = local_path(url)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if probe != path and not os.path.isdir(probe):
        # The nearest existing ancestor is a file: nothing can be made under it, whatever
        # its permissions say (access() on a plain file reads as "permission denied").
        raise StorageError(f"{setting}: {path}: {probe} is a file, not a directory")
    if write and os.path.exists(path) and not os.path.isdir(path):
        raise StorageError(f"{setting}: {path} exists and is not a directory")
    if write and not os.access(probe, os.W_OK | os.X_OK):
        # access() says no for a read-only mount even to root: name that cause, not permissions.
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            raise StorageError(f"{setting}: {path}: read-only file system (cannot write in {probe})")
        raise StorageError(f"{setting}: {path}: permission denied (cannot write in {probe})")
    if not write and not os.access(probe, os.R_OK):
        raise StorageError(f"{setting}: {path}: permission denied")
