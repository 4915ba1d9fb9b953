"""Launching a job's ranks on its launcher, and relaunching them from the latest checkpoint
when one is lost: the one effect of a training job that runs ranks (training.job)."""

from __future__ import annotations

import time

from shardline.foundation import report, storage
from shardline.foundation.errors import ConfigError, ShardlineError
from shardline.foundation.redact import redact

from .checkpoints import fingerprint
from .checkpoints.store import CheckpointStore
from .launchers import DriverGuard, TrainingFailed
from .mlflow_outage import Outbox
from .worker import RankJob, train_rank


def launch_with_restarts(job: RankJob, store: CheckpointStore, spark=None, dask_client=None, dask_workers=None,
                         guard: DriverGuard | None = None) -> dict:
    """Launch; when a rank is lost, relaunch from the latest checkpoint, max_restarts times.

    The launcher owns restarts: Spark does not retry a failed barrier result stage,
    and a Dask task on a killed worker is never resolved (both seen with Spark 4.3 and
    Dask 2026.8). A permanent failure (launchers.guard: permissions, a full disk, bad
    data) is never retried. Every attempt's ranks import the same code: the job's snapshot.
    """
    from mlflow.tracking import MlflowClient

    cfg = job.cfg
    # Restarts never wait on MLflow: the count is kept while the server is down.
    outbox = Outbox(MlflowClient(job.tracking_uri)) if job.tracking_uri and job.run_id else None
    for attempt in range(cfg.max_restarts + 1):
        try:
            result = _launch(job, spark, dask_client, attempt > 0, dask_workers, guard)[0]
            if outbox is not None:
                result["mlflow_pending"] = outbox.pending() + result.get("mlflow_pending", [])
            return result
        except TrainingFailed as e:
            if e.permanent or attempt == cfg.max_restarts:
                raise
            if guard is not None and (why := guard.gone()):
                raise ShardlineError(f"not restarting: {why}") from None  # another job has the directory
            # The newest checkpoint a rank can read (a truncated newest one is skipped, said once).
            # Comparable: a job resumed at another mesh restarts from the checkpoint it resumed
            # from (written at the old mesh) until it has written one of its own.
            found = store.readable(fingerprint.comparable(job.fingerprint), cfg.resume_allow_changed)
            latest = found[0] if found else None
            job.resume_from = latest
            if outbox is not None:
                outbox.send(("batch", job.run_id, [("restarts", float(attempt + 1), int(time.time() * 1000), 0)]))
            where = storage.name(latest) if latest else "the start"
            report.line(redact(f"[shardline] {e}; restarting from {where}"))
    raise AssertionError("unreachable")


def _launch(job: RankJob, spark, dask_client, relaunch: bool, dask_workers=None, guard=None) -> list:
    cfg = job.cfg
    if cfg.launcher == "spark":
        from .launchers.spark import launch_spark_barrier

        if spark is None:
            raise ConfigError("training.launcher = 'spark' needs a Spark session")
        return launch_spark_barrier(spark, train_rank, job, cfg.world_size, cfg.timeout_s, guard, code=job.code)
    if cfg.launcher == "dask":
        from .launchers.dask import launch_dask

        if dask_client is None:
            raise ConfigError("training.launcher = 'dask' needs a Dask client")
        # A relaunch waits for a lost worker's nanny to start a new one (minutes on a loaded
        # host), as long as it would wait for a stalled peer, then fails in one line.
        wait = cfg.timeout_s if relaunch else 0
        return launch_dask(dask_client, train_rank, job, cfg.world_size, cfg.timeout_s, wait, workers=dask_workers,
                           guard=guard, code=job.code)
    from .launchers.local import launch_local

    return launch_local(train_rank, job, cfg.world_size, cfg.timeout_s, guard, code=job.code)
