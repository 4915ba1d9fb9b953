"""Helpers for the storage tests that ranks import (spawned processes, Spark and Dask workers)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def hold_until_exists(marker: str, epoch: int, metrics: dict) -> bool:
    """An epoch hook (rank 0, after each epoch): block until `marker` exists, then go on."""
    deadline = time.monotonic() + 600
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return False


def create_only_race(url: str, writers: int) -> list[str]:
    """`writers` processes race to create `url`, each with its own index as content;
    their answers ("won"/"lost") by index."""
    code = (
        "import sys; from shardline.foundation import commit; "
        "print('won' if commit.create_only(sys.argv[1], sys.argv[2].encode()) else 'lost')"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url, str(i)], stdout=subprocess.PIPE, text=True)
        for i in range(writers)
    ]
    return [p.communicate(timeout=300)[0].strip() for p in procs]
