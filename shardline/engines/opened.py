"""The engines an API call runs on, opened and described through the reporter
(foundation.report): a SparkSession (checked before any work) or a Dask client."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

from shardline.foundation import report
from shardline.foundation.redact import redact
from shardline.foundation.report import stage

from .config import ShardlineConfig


def open_spark(cfg: ShardlineConfig, barrier_ranks: int | None = None):
    """The session, checked before any work: a barrier stage's slots (`barrier_ranks`),
    then the executors' environment (one probe task; Connect and cluster masters)."""
    from shardline.foundation.sessions import spark_session
    from shardline.foundation.spark_probe import check_executors, describe_executors
    from shardline.foundation.spark_setup import describe_spark, remote_url

    url = remote_url(cfg.spark)
    with stage(f"Connecting to Spark Connect {redact(url)}" if url else "Starting Spark"):
        spark = spark_session(cfg.spark)
    # Under spark-submit its --master wins over the config's: say which one runs.
    report.note(describe_spark(spark))
    if barrier_ranks:
        from shardline.training.launchers.spark import check_spark_slots

        check_spark_slots(spark, barrier_ranks)
    executors = check_executors(spark, cfg.spark.probe_timeout_s)
    if executors:
        report.note(describe_executors(executors))
    return spark


def spark_ranks(cfg: ShardlineConfig, launcher: str | None = None, world_size: int | None = None) -> int | None:
    """Ranks a Spark barrier stage will need, when training runs on Spark."""
    t = cfg.training
    return (world_size or t.world_size) if (launcher or t.launcher) == "spark" else None


@contextmanager
def engine_handle(cfg: ShardlineConfig, engine: str, barrier_ranks: int | None = None):
    """The SparkSession, or a Dask client (closed, with its embedded cluster, after)."""
    if engine == "spark":
        yield open_spark(cfg, barrier_ranks)
        return
    with open_dask(cfg) as client:
        yield client


@contextmanager
def prepare_engine(cfg: ShardlineConfig):
    from shardline.pipelines.engine_dask import DaskEngine
    from shardline.pipelines.engine_spark import SparkEngine

    wrap = SparkEngine if cfg.pipelines.engine == "spark" else DaskEngine
    with engine_handle(cfg, cfg.pipelines.engine) as handle:
        yield wrap(handle)


@contextmanager
def open_dask(cfg: ShardlineConfig):
    from shardline.foundation.sessions import close_quietly, dask_client

    where = cfg.dask.address or f"LocalCluster of {cfg.dask.n_workers} workers"
    with stage(f"Starting Dask ({where})"):
        client = dask_client(cfg.dask)
    cluster = None if cfg.dask.address else client.cluster
    try:
        yield client
    except BaseException:
        client.close()
        if cluster is not None:
            cluster.close()
        raise
    if cluster is None:
        client.close()
    else:
        close_quietly(client, cluster)


class Engines:
    """The engines one API call uses, each opened on first use: the caller's own SparkSession
    or Dask client when given (used as they are, never stopped or closed here), else started
    from the config. A Dask cluster started here is closed at the end; a SparkSession started
    here stays the process's active session (the next call reuses it, as pyspark does).

    barrier_ranks: slots a Spark barrier stage will need, checked when Spark is started here
    (a given session is checked by the training job itself).
    """

    def __init__(self, cfg: ShardlineConfig, spark=None, client=None, barrier_ranks: int | None = None):
        self._cfg, self._spark, self._client, self._ranks = cfg, spark, client, barrier_ranks
        self._adopted: set[str] = set()
        self._stack = ExitStack()

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def spark(self):
        if self._spark is None:
            self._spark = open_spark(self._cfg, self._ranks)
        elif "spark" not in self._adopted:
            from shardline.foundation.spark_setup import adopt_session, describe_spark

            adopt_session(self._spark)
            report.note(f"using the SparkSession given: {describe_spark(self._spark)}")
        self._adopted.add("spark")
        return self._spark

    def dask(self):
        if self._client is None:
            self._client = self._stack.enter_context(open_dask(self._cfg))
        elif "dask" not in self._adopted:
            from shardline.foundation.sessions import adopt_client

            adopt_client(self._client)
            report.note(f"using the Dask client given: scheduler {self._client.scheduler.address}")
        self._adopted.add("dask")
        return self._client

    def handle(self, engine: str):
        """The SparkSession or the Dask client; None for the local launcher."""
        return self.spark() if engine == "spark" else self.dask() if engine == "dask" else None

    def prepare_engine(self, engine: str):
        from shardline.pipelines.engine_dask import DaskEngine
        from shardline.pipelines.engine_spark import SparkEngine

        return SparkEngine(self.spark()) if engine == "spark" else DaskEngine(self.dask())
