"""Engine session factories: embedded local engines by default, a cluster by address."""

from __future__ import annotations

import logging


from .code_travel import ship_shardline_to_dask
from .engine_config import DaskConfig, SparkConfig
from .environ import restored
from .spark_setup import start_spark

# Imported inside the functions that use them: Dask (only with a Dask client).


def spark_session(cfg: SparkConfig):
    """A SparkSession: on the Spark Connect server `cfg.remote` (or `SPARK_REMOTE`) names,
    else classic Spark on `cfg.master`; under spark-submit, the session it started.

    The user's Spark settings win over shardline's defaults (foundation.spark_setup says
    which and how); our packages are shipped to executors that need them.
    """
    return start_spark(cfg)


def adopt_client(client) -> None:
    """A client the caller made (the Python API's `client=`): workers it reaches by address
    get our code as `dask.address` clients do; a LocalCluster's in this process run this
    machine's environment already."""
    ship_shardline_to_dask(client)


def dask_client(cfg: DaskConfig):
    """A Dask client: on the scheduler at `cfg.address`, or on an embedded LocalCluster."""
    from distributed import Client, LocalCluster

    # The P2P shuffle logs every shuffle's start and end as a warning.
    logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)
    if cfg.address:
        client = Client(cfg.address, timeout="30s")
        adopt_client(client)
        return client
    import dask

    # Each nanny hands its worker Dask's pre-spawn variables (OMP_NUM_THREADS=1, ...,
    # PYTHONHASHSEED) by setting them in *this* process's environment, and leaves them there.
    # A Spark JVM this driver starts afterwards, and its Python workers, would inherit them:
    # Spark scoring ran 1.88 s instead of 1.58 s (median of 6, 800k rows, Dask started first).
    # The workers keep them; the driver gets its own environment back. (A worker the nanny
    # restarts later sets them again: Dask's doing, not undone here.)
    spawn_env = [*dask.config.get("distributed.nanny.pre-spawn-environ", {}), "PYTHONHASHSEED"]
    # Except MALLOC_TRIM_THRESHOLD_=65536: setting it turns off glibc's adaptive mmap
    # threshold, so every large buffer (each batch's arrays) is mmapped and page-faulted
    # afresh. Dask scoring ran 1.37-1.53 s with it, 1.00-1.09 s without (800k rows, medians
    # of 6). The embedded workers keep glibc's default, as plain processes and Spark's Python
    # workers do; a cluster's workers follow its own Dask config (docs/deploy.md).
    no_trim = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}
    with dask.config.set(no_trim), restored(spawn_env):
        cluster = LocalCluster(
            n_workers=cfg.n_workers,
            threads_per_worker=cfg.threads_per_worker,
            processes=True,
            memory_limit=cfg.memory_limit,
            dashboard_address=None,
            # With no dashboard the scheduler still serves its HTTP routes (health, metrics) on
            # 8787, and says in four lines of warning that it moved when another process holds
            # that port. Any free port of loopback, which nobody is told about, says nothing.
            scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
        )
    return Client(cluster)


# Loggers whose shutdown messages are noise once a run succeeded: a worker's heartbeat to a
# scheduler already gone (with its traceback), its comms closing, the nanny killing a
# worker slow to exit.
_SHUTDOWN_NOISE = ("distributed.worker", "distributed.core", "distributed.comm", "distributed.batched",
                   "distributed.nanny", "distributed.worker_memory")


def _silence_shutdown_noise() -> None:
    for name in _SHUTDOWN_NOISE:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def close_quietly(client, cluster) -> None:
    """Close the embedded LocalCluster after a run that succeeded, without its shutdown noise.

    Closing it, the nanny gives each worker 4 s to exit, then says "Worker process still
    alive after 4.0 seconds, killing", and a worker whose heartbeat meets the closed
    scheduler logs "Failed to communicate with scheduler during heartbeat" with a
    traceback: neither says anything about the user's run, which is over and written.
    Their loggers go quiet (in the workers, and the nannies here) for the close only; a
    run that failed closes as before, its messages kept.
    """
    try:
        client.run(_silence_shutdown_noise)
    except Exception:  # a worker already gone: nothing of it to silence
        pass
    here = {name: logging.getLogger(name).level for name in _SHUTDOWN_NOISE}
    for name in here:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        client.close()
        cluster.close()
    finally:
        for name, level in here.items():
            logging.getLogger(name).setLevel(level)
