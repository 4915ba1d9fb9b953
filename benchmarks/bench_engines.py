"""The engines `bench scale` and `bench shapes` run on, one object each: how to start one on N
cores and stop it, how the API is given it, how ranks are launched on it, and which
processes (benchmarks.proc_tree roles) run its ranks. The benchmarks ask these; they never
branch on an engine's name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class BenchEngine:
    name: str
    open: Callable[[int], Any]  # cores -> the handle (a SparkSession, a Dask Client)
    close: Callable[[Any], None]
    given: Callable[[Any], dict]  # the API's keyword for the handle
    launch: Callable[..., list]  # (handle, fn, payload, world_size) -> results by rank
    rank_role: str  # the proc_tree role of the processes a rank runs in
    spawned_as: str  # what proc_tree's spawned processes are under this engine


def _open_spark(cores: int):
    """A SparkSession on local[cores]; the process's session stopped first (one SparkContext
    at a time)."""
    from pyspark.sql import SparkSession

    from shardline.foundation.engine_config import SparkConfig
    from shardline.foundation.sessions import spark_session

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    return spark_session(SparkConfig(master=f"local[{cores}]"))


def _open_dask(cores: int):
    from shardline.foundation.engine_config import DaskConfig
    from shardline.foundation.sessions import dask_client

    return dask_client(DaskConfig(n_workers=cores, threads_per_worker=1))


def _close_dask(client) -> None:
    cluster = client.cluster
    client.close()
    cluster.close()


def _launch_spark(*args):
    from shardline.engines.spark.launch import launch_spark_barrier

    return launch_spark_barrier(*args)


def _launch_dask(*args):
    from shardline.engines.dask.launch import launch_dask

    return launch_dask(*args)


ENGINES = {
    "spark": BenchEngine("spark", _open_spark, lambda s: s.stop(), lambda s: {"spark": s}, _launch_spark,
                         rank_role="spark_python", spawned_as="rank"),
    "dask": BenchEngine("dask", _open_dask, _close_dask, lambda c: {"client": c}, _launch_dask,
                        rank_role="dask_worker", spawned_as="dask_worker"),
}
