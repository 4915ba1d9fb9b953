"""A real small disk for full-disk tests: a tmpfs of a given size, mounted as root.

`small_disk(path)` mounts it for the block and unmounts it afterwards even when the
test fails (lazily, if a straggling process still has a file open there). `fill(path)`
takes every free byte with one file, as a disk filled by someone else would be;
`grow(path, size)` remounts it larger with its files kept, as a freed disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pytest


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def small_disk(path: Path, size: str = "1m"):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")  # CI and this machine run as root
    path.mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        try:
            _run("umount", str(path))
        except subprocess.CalledProcessError:
            _run("umount", "-l", str(path))  # busy: detach now, freed when the last file closes


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
