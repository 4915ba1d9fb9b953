"""Zips this process ships to executors and workers: shardline's own package
(foundation.sessions) and the user's code (foundation.code_travel).

Both need the same two things, so they live here once:
- **Named by content.** A zip's bytes depend only on its files' names and contents (fixed
  timestamps), and its name on a hash of them: the same code is the same artifact (Spark
  accepts it again, Dask replaces its plugin by name), changed code a new one.
- **Nothing left in /tmp.** They are written into a folder this process holds locked for
  its life and removes at exit; the folders of processes that are gone (SIGKILL runs no
  atexit) are removed by the next process that makes a zip, and only those: a lock is
  released by the kernel however its process ends.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Iterable
from pathlib import Path

LOCK = threading.RLock()
_DIR: str | None = None
_LIVE = "shardline-zips-"  # a folder of zips its process holds locked
_NEW = ".shardline-zips-new-"  # its name while made: another process's sweep never sees it unlocked


def content_zip(prefix: str, files: Iterable[tuple]) -> str:
    """The zip of `files` ((name in the zip, file) or (name, bytes, mode), in order) as
    `<prefix><sha>.zip` in this process's folder, written once per content."""
    datas = [f if len(f) == 3 else (f[0], Path(f[1]).read_bytes(), Path(f[1]).stat().st_mode) for f in files]
    digest = hashlib.sha256()
    for arc, data, _ in datas:
        digest.update(arc.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    path = os.path.join(own_dir(), f"{prefix}{digest.hexdigest()[:16]}.zip")
    with LOCK:
        if not os.path.exists(path):
            tmp = path + ".part"
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
                for arc, data, mode in datas:
                    info = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
                    info.external_attr = (mode & 0o777) << 16
                    info.compress_type = zipfile.ZIP_DEFLATED
                    z.writestr(info, data)
            os.replace(tmp, path)
    return path


def own_dir() -> str:
    """This process's folder of zips, locked for its life and removed at its exit."""
    global _DIR
    with LOCK:
        if _DIR is None:
            tmp = tempfile.gettempdir()
            remove_orphans(tmp)
            new = tempfile.mkdtemp(prefix=_NEW, dir=tmp)
            fd = os.open(os.path.join(new, ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until this process ends
            _DIR = os.path.join(tmp, _LIVE + os.path.basename(new).removeprefix(_NEW))
            os.rename(new, _DIR)
            atexit.register(shutil.rmtree, _DIR, True)
        return _DIR


def remove_orphans(folder: str) -> None:
    """Remove the zip folders in `folder` whose process is gone."""
    for d in Path(folder).glob(f"{_LIVE}*"):
        with contextlib.suppress(OSError):
            fd = os.open(d / ".lock", os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its process lives
                shutil.rmtree(d, ignore_errors=True)
            finally:
                os.close(fd)
