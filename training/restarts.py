"""Launching a job's ranks on its launcher, and relaunching them from the latest checkpoint
when one is lost: the one effect of a training job that runs ranks (training.job)."""

from __future__ import annotations

import time

from shardline.foundation import report, storage
from shardline.foundation.errors import ShardlineError
from shardline.foundation.redact import redact

from .checkpoints import fingerprint
from .checkpoints.store import CheckpointStore
from .launchers import DriverGuard, TrainingFailed
from .mlflow_outage import Outbox
from .loop.runner import RankJob, run_rank

# Imported inside the functions that use them: MLflow (~2.5 s: only where MLflow is called).


def launch_with_restarts(job: RankJob, store: CheckpointStore | None, engine, workers=None,
                         guard: DriverGuard | None = None) -> dict:
    """Launch on `engine` (its launch_ranks: shardline.engines.base.Engine); when a rank is
    lost, relaunch from the latest checkpoint, max_restarts times. workers: where to pin the
    ranks (a sweep's trial), for engines that pin them.

    The launcher owns restarts: Spark does not retry a failed barrier result stage,
    and a Dask task on a killed worker is never resolved (both seen with Spark 4.3 and
    Dask 2026.8). A permanent failure (launchers.guard: permissions, a full disk, bad
    data) is never retried. Every attempt's ranks import the same code: the job's snapshot.
    store None: a distributed function with no checkpoint folder, relaunched from its start.
    """
    from mlflow.tracking import MlflowClient

    cfg = job.cfg
    # Restarts never wait on MLflow: the count is kept while the server is down.
    outbox = Outbox(MlflowClient(job.tracking_uri)) if job.tracking_uri and job.run_id else None
    for attempt in range(cfg.max_restarts + 1):
        try:
            results = engine.launch_ranks(run_rank, job, cfg.world_size, cfg.timeout_s, guard=guard, code=job.code,
                                          relaunch=attempt > 0, workers=workers)
            # Every rank's MLflow calls kept during an outage (a loop may log on any rank).
            kept = [entry for r in results for entry in (r or {}).get("mlflow_pending", [])]
            result = {**results[0], "mlflow_pending": (outbox.pending() if outbox is not None else []) + kept}
            return result
        except TrainingFailed as e:
            if e.permanent or attempt == cfg.max_restarts:
                raise
            if guard is not None and (why := guard.gone()):
                raise ShardlineError(f"not restarting: {why}") from None  # another job has the directory
            # The newest checkpoint a rank can read (a truncated newest one is skipped, said once).
            # Comparable: a job resumed at another mesh restarts from the checkpoint it resumed
            # from (written at the old mesh) until it has written one of its own.
            found = store.readable(fingerprint.comparable(job.fingerprint), cfg.resume_allow_changed) \
                if store is not None else None
            latest = found[0] if found else None
            job.resume_from = latest
            if outbox is not None:
                outbox.send(("batch", job.run_id, [("restarts", float(attempt + 1), int(time.time() * 1000), 0)]))
            where = storage.name(latest) if latest else _from_the_start(job, store)
            report.line(redact(f"[shardline] {e}; restarting from {where}"))
    raise AssertionError("unreachable")


def _from_the_start(job: RankJob, store: CheckpointStore | None) -> str:
    """Where a relaunch begins when there is no checkpoint, and why, for the restart line."""
    if job.call is not None:
        return ("the start (the function has committed no checkpoint: shardline.context().save)" if store
                else "the start (shardline.distribute was given no checkpoint_dir)")
    return "the start (the loop has committed no checkpoint: ctx.save)" if job.loop else "the start"

