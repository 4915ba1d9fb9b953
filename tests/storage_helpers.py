"""Helpers for the storage tests that ranks import (spawned processes, Spark and Dask workers)."""

from __future__ import annotations

import os
import time


def hold_until_exists(marker: str, epoch: int, metrics: dict) -> bool:
    """An epoch hook (rank 0, after each epoch): block until `marker` exists, then go on."""
    deadline = time.monotonic() + 600
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return False
