"""The commit protocol's conditional steps, the same on every store (foundation.storage).

`create_only` publishes a finished object under a name only if nothing is there: the
one commit step of every write. `read_tagged` + `replace_if` / `delete_if` change a
small control object only if it did not change since it was read: leases
(`foundation.lease`) are built on them. A local path does each with a temp file,
link(2) or rename(2) and flock of its directory; an object store with its conditional
requests (`foundation.object_stores`, docs/storage.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator

from . import object_stores
from .storage import fsync_dir, is_remote, is_temp_of, local_path, name, temp_name


def remove_stale_temps(url: str, older_than_s: float) -> None:
    """Remove local temporaries of `url` (`temp_name`) not touched for `older_than_s`:
    a live writer's temp lives for milliseconds, so an old one is a dead writer's."""
    if is_remote(url):
        return  # object stores get whole objects: no temporaries
    d, base = os.path.dirname(local_path(url)), name(url)
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(d):
            if is_temp_of(entry.name, base):
                with contextlib.suppress(OSError):
                    if now - entry.stat().st_mtime > older_than_s:
                        os.unlink(entry.path)


def _temp_beside(path: str, data: bytes) -> str:
    """`data` written and fsynced to a temp name in `path`'s directory; its path. Nothing
    is left when the write fails (a full disk would otherwise keep a 0-byte temp)."""
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, temp_name(os.path.basename(path)))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


@contextlib.contextmanager
def _dir_locked(path: str) -> Iterator[int]:
    """flock of `path`'s directory: read-compare-write one step for every process on this
    host (the only ones that can see a local path). Yields the directory's fd."""
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def create_only(url: str, data: bytes) -> str | None:
    """Publish `data` at `url` only if nothing is there: the one commit step.

    Returns the new object's tag (for `replace_if`), or None when `url` already
    existed (someone else committed first; nothing was changed).
    """
    if is_remote(url):
        return object_stores.create_only(url, data)
    path = local_path(url)
    tmp = _temp_beside(path, data)
    try:
        # link(2) fails if the name exists, and the content is whole before it has a name.
        os.link(tmp, path)
    except FileExistsError:
        return None
    finally:
        os.unlink(tmp)
    fsync_dir(os.path.dirname(path))
    return _local_tag(data)


def read_tagged(url: str) -> tuple[bytes, str] | None:
    """(content, tag) of a control object, or None if there is none."""
    if is_remote(url):
        return object_stores.read_tagged(url)
    try:
        with open(local_path(url), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return data, _local_tag(data)


def replace_if(url: str, data: bytes, tag: str) -> str | None:
    """Replace `url` with `data` only if it still has `tag`; the new tag, or None if it changed."""
    if is_remote(url):
        return object_stores.replace_if(url, data, tag)
    path = local_path(url)
    with _dir_locked(path) as fd:
        current = read_tagged(url)
        if current is None or current[1] != tag:
            return None
        tmp = _temp_beside(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.fsync(fd)
    return _local_tag(data)


def delete_if(url: str, tag: str) -> bool:
    """Delete `url` only if it still has `tag`; False if it changed or is gone."""
    if is_remote(url):
        return object_stores.delete_if(url, tag)
    path = local_path(url)
    with _dir_locked(path) as fd:
        current = read_tagged(url)
        if current is None or current[1] != tag:
            return False
        os.unlink(path)
        os.fsync(fd)
    return True


def _local_tag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
