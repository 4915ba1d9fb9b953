"""Spark, classic and Connect, as one engine: prepare's tasks and shuffle (prepare), scoring's
tasks (score), training's barrier stage (launch). Only the DataFrame API runs tasks, so every
stage runs on Spark Connect too (no SparkContext, no RDD)."""

from __future__ import annotations

from urllib.parse import urlparse

from shardline.foundation import report
from shardline.foundation.code_travel import ship_to_spark
from shardline.foundation.engine_config import on_loopback
from shardline.foundation.progress import route_to
from shardline.foundation.redact import redact
from shardline.foundation.report import stage
from shardline.foundation.sessions import spark_session
from shardline.foundation.spark_probe import check_executors, describe_executors
from shardline.foundation.spark_setup import (
    adopt_session,
    connect_url,
    describe_spark,
    is_connect,
    remote_url,
    spark_master,
    spark_setting,
)

from ..base import Engine, Slots
from . import score
from .launch import check_spark_slots, launch_spark_barrier, spark_task_slots

# Imported inside the functions that use them: engines.spark.prepare (a cycle: it imports this module).


class SparkEngine(Engine):
    """A SparkSession (classic or Connect). A session started here stays the process's active
    session after the job (the next call reuses it, as pyspark does): `close` stops nothing."""

    name = "spark"
    reads_tables = True

    def __init__(self, spark):
        self.spark = spark
        self.version = spark.version
        self._slots: Slots | None = None

    @classmethod
    def open(cls, cfg, given=None, ranks: int | None = None) -> SparkEngine:
        """The session, checked before any work: a barrier stage's slots (`ranks`), then the
        executors' environment (one probe task; Connect and cluster masters). A session given
        is adopted as it is (our code shipped to its executors); the training job checks its slots."""
        if given is not None:
            adopt_session(given)
            report.note(f"using the SparkSession given: {describe_spark(given)}")
            return cls(given)
        url = remote_url(cfg.spark)
        with stage(f"Connecting to Spark Connect {redact(url)}" if url else "Starting Spark"):
            spark = spark_session(cfg.spark)
        # Under spark-submit its --master wins over the config's: say which one runs.
        report.note(describe_spark(spark))
        if ranks:
            check_spark_slots(spark, ranks)
        executors = check_executors(spark, cfg.spark.probe_timeout_s)
        if executors:
            report.note(describe_executors(executors))
        return cls(spark)

    @classmethod
    def cluster(cls, cfg, given=None) -> str | None:
        if given is not None:
            if is_connect(given):
                return "the Spark Connect session given"
            master = spark_master(given)
            return None if _here(master) else f"the SparkSession given (master {master!r})"
        remote = remote_url(cfg.spark)  # a malformed one: a config error, said first
        if remote:
            return f"Spark Connect at {remote!r}"
        return None if _here(cfg.spark.master) else f"spark.master = {cfg.spark.master!r}"

    @classmethod
    def owns_frame(cls, df) -> bool:
        return hasattr(df, "sparkSession") and hasattr(df, "mapInArrow")

    @classmethod
    def frame_session(cls, df):
        return df.sparkSession

    def listen_address(self) -> str:
        spark = self.spark
        if is_connect(spark):  # the tasks run on the Connect server's cluster
            return route_to(urlparse((connect_url(spark) or "").replace("sc://", "http://")).hostname)
        master = spark_master(spark)
        if master.startswith("local"):
            return "127.0.0.1"
        return spark_setting(spark, "spark.driver.host") or route_to(urlparse(master.replace("spark://", "http://")).hostname)

    def ship_code(self, code):
        return ship_to_spark(self.spark, code)

    def slots(self, threads_per_rank: int = 1) -> Slots:
        # Asked once per engine: a local[*] master counts its cores with a Spark job.
        if self._slots is None:
            s = spark_task_slots(self.spark)
            self._slots = Slots(s.count, f"{s.count} task slots of {s.where}")
        return self._slots

    def run(self, fn, items: list) -> list:
        from . import prepare  # prepare's task code (pipelines.tasks: pandas, ~0.7 s): only a prepare imports it

        return prepare.run_tasks(self.spark, fn, items)

    def shuffle_write(self, sources: list, read, schema, parts: int, write, out_schema) -> list[dict]:
        from . import prepare  # as in run

        return prepare.shuffle_write(self.spark, sources, read, schema, parts, write, out_schema)

    def stage_frame(self, df, folder: str) -> int:
        from . import prepare  # as in run

        return prepare.stage_frame(df, folder)

    def table_frame(self, src):
        from . import prepare  # as in run

        return prepare.table_frame(self.spark, src)

    def run_units(self, tasks: list) -> list[dict]:
        return score.run_units(self.spark, tasks)

    def check_capacity(self, world_size: int, setting: str = "training.world_size") -> None:
        check_spark_slots(self.spark, world_size, setting)
        check_executors(self.spark)  # once per session: opening it has usually run it already

    def launch_ranks(self, fn, payload, world_size: int, timeout_s: float, *, guard=None, code=None,
                     relaunch: bool = False, workers=None) -> list:
        # A barrier stage places its tasks itself; a relaunch is a new stage like the first.
        return launch_spark_barrier(self.spark, fn, payload, world_size, timeout_s, guard, code=code)


def _here(master: str) -> bool:
    """A master whose tasks run on this machine: local[...] or a cluster on loopback (#53 item 10)."""
    return master.startswith("local") or on_loopback(master)
