"""A real small disk for full-disk tests: a tmpfs of a given size, mounted as root.

`small_disk(path)` mounts it for the block and unmounts it afterwards even when the
test fails (faults_helpers.mounted_tmpfs). `fill(path)`
takes every free byte with one file, as a disk filled by someone else would be;
`grow(path, size)` remounts it larger with its files kept, as a freed disk.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
from pathlib import Path

from .faults_helpers import mounted_tmpfs


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def small_disk(path: Path, size: str = "1m"):
    with mounted_tmpfs(path, f"size={size}"):  # unmounted after, also on failure
        yield path


def fill(path: Path, leave: int = 0) -> Path:
    """One file taking every free byte of the disk at `path` but `leave` (whole pages)."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        if leave:
            f.truncate(max(0, f.tell() - leave))
    return filler


def grow(path: Path, size: str = "64m") -> None:
    _run("mount", "-o", f"remount,size={size}", str(path))
