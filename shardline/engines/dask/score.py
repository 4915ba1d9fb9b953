"""Scoring on Dask: one task per input unit."""

from __future__ import annotations

from shardline.serving.worker import UnitTask, score_unit


def run_units(client, tasks: list[UnitTask], retries: int = 2) -> list[dict]:
    # pure=False: the same unit scored again (a later run) must run, not hit a cached result.
    # Retries are safe because a unit rewrites the same output name.
    futures = client.map(score_unit, tasks, pure=False, retries=retries)
    return client.gather(futures)
