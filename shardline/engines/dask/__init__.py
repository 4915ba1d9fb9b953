"""Dask as one engine: prepare's futures and dataframe shuffle (prepare), scoring's tasks
(score), training's ranks pinned one per worker (launch)."""

from __future__ import annotations

from urllib.parse import urlparse

from shardline.foundation import report
from shardline.foundation.code_travel import ship_to_dask
from shardline.foundation.engine_config import on_loopback
from shardline.foundation.progress import route_to
from shardline.foundation.report import stage
from shardline.foundation.sessions import adopt_client, close_quietly, dask_client

from ..base import Engine, Slots
from . import score
from .launch import check_dask_workers, launch_dask

# Imported inside the functions that use them: Dask (only with a Dask client); engines.dask.prepare (a cycle:
# it imports this module).


class DaskEngine(Engine):
    """A Dask client: on the scheduler at `dask.address`, on an embedded LocalCluster (closed
    with the engine), or the caller's own (never closed here)."""

    name = "dask"

    def __init__(self, client, cluster=None):
        import dask  # the client is Dask's: dask is imported already

        self.client = client
        self.version = dask.__version__
        self._cluster = cluster  # the embedded LocalCluster this engine started, closed with it
        self._started = False

    @classmethod
    def open(cls, cfg, given=None, ranks: int | None = None) -> DaskEngine:
        """Started from `cfg.dask`, or the client given (its workers get our code). `ranks` is
        not checked here: a cluster's workers may still be joining; the training job checks them."""
        if given is not None:
            adopt_client(given)
            report.note(f"using the Dask client given: scheduler {given.scheduler.address}")
            return cls(given)
        where = cfg.dask.address or f"LocalCluster of {cfg.dask.n_workers} workers"
        with stage(f"Starting Dask ({where})"):
            client = dask_client(cfg.dask)
        engine = cls(client, None if cfg.dask.address else client.cluster)
        engine._started = True
        return engine

    def close(self, failed: bool = False) -> None:
        if not self._started:
            return
        if self._cluster is None:
            self.client.close()
        elif failed:  # its shutdown messages may say why
            self.client.close()
            self._cluster.close()
        else:
            close_quietly(self.client, self._cluster)

    @classmethod
    def cluster(cls, cfg, given=None) -> str | None:
        if given is not None:  # a scheduler reached by its address, not a LocalCluster of this process
            here = getattr(given, "cluster", None) is not None or on_loopback(given.scheduler.address)
            return None if here else f"the Dask client given (scheduler {given.scheduler.address})"
        return f"dask.address = {cfg.dask.address!r}" if cfg.dask.address and not on_loopback(cfg.dask.address) else None

    @classmethod
    def owns_frame(cls, df) -> bool:
        return hasattr(df, "map_partitions") and hasattr(df, "npartitions")

    @classmethod
    def frame_session(cls, df):
        from distributed import default_client  # a Dask DataFrame was given: distributed is there

        try:
            return default_client()
        except ValueError:  # no client: the config's Dask engine starts
            return None

    def listen_address(self) -> str:
        return route_to(urlparse(self.client.scheduler.address).hostname)

    def ship_code(self, code):
        return ship_to_dask(self.client, code)

    def slots(self, threads_per_rank: int = 1) -> Slots:
        workers = tuple(sorted(self.client.scheduler_info()["workers"]))
        return Slots(len(workers), f"{len(workers)} Dask workers of {self.client.scheduler.address}",
                     workers=workers)

    def run(self, fn, items: list) -> list:
        futures = self.client.map(fn, items, pure=False)
        try:
            return self.client.gather(futures)
        finally:
            self.client.cancel(futures)

    def shuffle_write(self, sources: list, read, schema, parts: int, write, out_schema) -> list[dict]:
        from . import prepare  # pandas and dask.dataframe (~0.7 s): only a Dask prepare imports them

        return prepare.shuffle_write(sources, read, schema, parts, write, out_schema)

    def stage_frame(self, df, folder: str) -> int:
        from . import prepare  # as in shuffle_write

        return prepare.stage_frame(df, folder)

    def run_units(self, tasks: list) -> list[dict]:
        return score.run_units(self.client, tasks)

    def check_capacity(self, world_size: int, setting: str = "training.world_size") -> None:
        check_dask_workers(self.client, world_size)

    def launch_ranks(self, fn, payload, world_size: int, timeout_s: float, *, guard=None, code=None,
                     relaunch: bool = False, workers=None) -> list:
        # A relaunch waits for a lost worker's nanny to start a new one (minutes on a loaded
        # host), as long as it would wait for a stalled peer, then fails in one line.
        return launch_dask(self.client, fn, payload, world_size, timeout_s, timeout_s if relaunch else 0,
                           workers=list(workers) if workers else None, guard=guard, code=code)
