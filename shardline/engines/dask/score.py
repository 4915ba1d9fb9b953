"""Scoring on Dask: one task per input unit."""

from __future__ import annotations

from shardline.foundation import report, storage
from shardline.foundation.dask_wait import interruptible_wait

from shardline.serving.worker import UnitTask, score_unit


def run_units(client, tasks: list[UnitTask], retries: int = 2) -> list[dict]:
    # pure=False: the same unit scored again (a later run) must run, not hit a cached result.
    # Retries are safe because a unit rewrites the same output name.
    futures = client.map(score_unit, tasks, pure=False, retries=retries)
    try:
        # Not client.gather: a Ctrl-C there leaves asyncio tracebacks behind (foundation.dask_wait).
        interruptible_wait(futures, stop_at_error=True)
    except KeyboardInterrupt:
        client.cancel(futures)
        raise
    results = client.gather(futures)  # done: raises the first failed unit's error, if any
    say_redone(client, {f.key: t for f, t in zip(futures, tasks)})
    return results


def say_redone(client, units: dict) -> None:
    """A worker that left the cluster mid-unit (killed, its host lost) took that attempt with
    it; Dask runs the unit again on another worker, silently. Say which units were lost with
    which worker and scored again (their half-written files are removed by the ledger's
    cleanup), from the scheduler's own record of the removal: its "remove-worker" event names
    the tasks the worker was processing (`units`: this job's, by task key)."""
    try:
        events = client.get_events("all")
    except Exception:  # noqa: BLE001 - an old scheduler, or it is gone: the scores are committed anyway
        return
    for _, event in events:
        if not isinstance(event, dict) or event.get("action") != "remove-worker":
            continue
        lost = [units[k] for k in event.get("processing-tasks", ()) if k in units]
        if lost:
            names = ", ".join(storage.display(t.unit.path) for t in lost)
            report.line(f"[shardline] score: Dask worker {event.get('worker')} left the cluster while scoring "
                        f"{len(lost)} unit(s) ({names}); scored again on another worker, its partial "
                        "output discarded")
