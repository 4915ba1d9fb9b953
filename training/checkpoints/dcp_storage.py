"""torch.distributed.checkpoint (DCP) on any store `foundation.storage` reaches.

DCP's own writer and reader take a local path; its fsspec variant would reach
object stores through s3fs, which cannot be installed beside this project's boto3
(aiobotocore pins another botocore). This is DCP's `FileSystemBase` seam filled with
`foundation.storage` (pyarrow.fs and boto3), so fsdp and tensor checkpoints go to
S3, GCS, ABFS or HDFS like every other checkpoint.

What each DCP step becomes on an object store:
- a rank's shard file (`__<rank>_0.distcp`) is spooled (memory, then a temp file)
  and uploaded whole when DCP closes it: one PUT, never a partial object;
- `.metadata` is written by rank 0 after every rank's files (DCP's own order) as
  `.metadata.tmp`, then "renamed": copied to `.metadata` and the temporary deleted,
  since object stores have no rename. Nothing reads `.metadata` before the small
  checkpoint file naming the directory exists, and that file is written after
  `dcp.save` returns (`training.checkpoints.sharded`), so a directory left half
  written by a lost rank is never pointed to, and is pruned later;
- reads fetch a whole shard file once and serve DCP's byte ranges from memory: a
  rank's own file is what it loads (at another mesh, the files holding its pieces).

Local paths keep DCP's own file system (fsync, atomic rename).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from shardline.foundation import storage


class StoreFileSystem(FileSystemBase):
    """DCP's file-system interface over `foundation.storage` URLs."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        url = os.fspath(path)
        if "r" in mode:
            with io.BytesIO(storage.read_bytes(url)) as f:
                yield f
            return
        with storage.write(url) as f:  # uploaded whole when the block ends, not if it raises
            yield _KeptOpen(f)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return storage.join(os.fspath(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        # Only DCP's `.metadata.tmp` -> `.metadata` (small): copy, then delete.
        storage.write_bytes(os.fspath(new_path), storage.read_bytes(os.fspath(path)))
        storage.delete(os.fspath(path))

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        pass  # object stores have no directories: a key's prefix is one

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, str) and storage.is_remote(checkpoint_id)

    def exists(self, path: str | os.PathLike) -> bool:
        return storage.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        storage.delete(os.fspath(path))


class _KeptOpen(io.RawIOBase):
    """A spool DCP may `close()` inside the block (its writer threads do): the upload
    happens when the block ends, so closing must not discard the bytes first."""

    def __init__(self, f):
        self._f = f

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self._f.write(b)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        pass


class NotingFileSystem(FileSystem):
    """DCP's own local file system, keeping the OSError a write met (`failed`).

    DCP writes a tensor with torch.save into the open file, and torch's stream writer turns
    a write's OSError into "[enforce fail ...] unexpected pos 704 vs 598": a full disk would
    read as a bug, and be retried as one. The error seen here says what happened."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: OSError | None = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            yield _Noting(stream, self) if "w" in mode else stream


class _Noting:
    """A file whose writes' OSError its file system keeps; everything else is the file's."""

    def __init__(self, stream, fs: NotingFileSystem):
        self._stream, self._fs = stream, fs

    def write(self, b) -> int:
        try:
            return self._stream.write(b)
        except OSError as e:
            self._fs.failed = self._fs.failed or e
            raise

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def writer(directory: str) -> dcp.FileSystemWriter:
    if not storage.is_remote(directory):
        w = dcp.FileSystemWriter(storage.local_path(directory))
        w.fs = NotingFileSystem()
        return w
    # sync_files: fsync means nothing for an upload; the PUT is durable when it returns.
    w = dcp.FileSystemWriter(directory, sync_files=False)
    w.fs, w.path = StoreFileSystem(), directory
    return w


def reader(directory: str) -> dcp.FileSystemReader:
    if not storage.is_remote(directory):
        return dcp.FileSystemReader(storage.local_path(directory))
    r = dcp.FileSystemReader(directory)
    r.fs, r.path = StoreFileSystem(), directory
    return r
