"""The engine a job runs on, as one object: what every stage asks of it.

An engine is chosen once, by the API (shardline.api, the estimators, the fault runner,
the benchmarks), from the setting that names it — `pipelines.engine`, `training.launcher`,
`serving.engine`, `sweep.engine`: "spark", "dask" or "local", the names of the registry
(shardline.engines.registry) — opened, or made from the caller's own SparkSession or Dask
client, and passed down. The stages call the methods below and nothing else: none asks an
engine's name to decide what to do, and none imports this package (dependencies point one
way: shardline → serving → training → pipelines → shardline.foundation); each stage names
what it relies on in its own words (pipelines.prepare.PrepareEngine, the docstrings of
serving.score.execute and training.job.TrainingJob.run).

Spark (classic and Connect), Dask and local processes each keep every stage's code for
their engine in one folder: shardline/engines/<name>/ (prepare, score, launch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from shardline.foundation.errors import ConfigError


@dataclass(frozen=True)
class Slots:
    """How many ranks (or tasks) an engine runs at once, as far as it can tell."""

    count: int | None  # None: nothing bounds it (a cluster whose size no setting says)
    where: str  # what was counted, for a refusal: "2 task slots of Spark master local[2]"
    per_rank: int = 1  # slots one rank takes (a local rank: its threads' cores)
    workers: tuple[str, ...] = ()  # the places a rank can be pinned to, in order (Dask workers); () if none


class Engine(ABC):
    """One engine of a job. `name` is its registry name (the settings' value); `version` is
    what a prepared dataset's manifest records as the engine that wrote it."""

    name: ClassVar[str]
    version: str = ""
    # A Spark catalog and SQL (pipelines.source.format = "table"): checked before it opens.
    reads_tables: ClassVar[bool] = False

    # -- opening and closing (shardline.engines.opened.Engines) ---------------------------

    @classmethod
    @abstractmethod
    def open(cls, cfg, given=None, ranks: int | None = None) -> Engine:
        """The engine of `cfg` (a ShardlineConfig: its `spark` or `dask` section), started and
        checked, its start said through the reporter; or, given the caller's own session or
        client, that one (used as it is, never stopped by `close`). ranks: a barrier stage's
        task slots to check at once, when training will run on this engine."""

    def close(self, failed: bool = False) -> None:
        """Stop what `open` started (an embedded cluster); `failed`: the job failed, so its
        shutdown messages are kept. The caller's own session or client stays open."""

    @classmethod
    @abstractmethod
    def cluster(cls, cfg, given=None) -> str | None:
        """The setting (or the session or client given) that sends this engine's tasks to other
        hosts, or None when every task runs on this machine. shardline.config.resolve_paths
        refuses relative paths and notes shared ones by it, before the engine opens."""

    @classmethod
    def hosts_before_launch(cls, world_size: int) -> list[str] | None:
        """Each rank's host where the engine decides it before launch (the mesh grid of
        `shardline plan`, training.rank_grid); None where it places ranks at launch (a Spark
        barrier stage's tasks, the Dask workers a job is given), where the ranks report them."""
        return None

    @classmethod
    def owns_frame(cls, df) -> bool:
        """`df` is a DataFrame of this engine (`shardline.prepare(source=df)`)."""
        return False

    @classmethod
    def frame_session(cls, df):
        """The session or client to prepare `df` on when the caller gave none (None: open one)."""
        return None

    # -- every stage -----------------------------------------------------------------------

    @abstractmethod
    def listen_address(self) -> str:
        """This host's address that the engine's tasks and ranks reach (foundation.progress:
        their lines and counts show on the driver's console)."""

    @abstractmethod
    def ship_code(self, code):
        """The user's code snapshot (foundation.code_travel.UserCode, or None) made importable
        where the engine runs tasks; returns it for the tasks to make current (use_code)."""

    @abstractmethod
    def slots(self, threads_per_rank: int = 1) -> Slots:
        """How many ranks it runs at once (training.sweeps: parallel trials; scoring: how
        many tasks to deal units into)."""

    # -- prepare (pipelines.prepare, pipelines.frames, pipelines.synthetic) ----------------

    @abstractmethod
    def run(self, fn: Callable[[Any], Any], items: list) -> list:
        """fn(item) for every item, one task each; JSON-able results in item order."""

    @abstractmethod
    def shuffle_write(self, sources: list, read, schema, parts: int, write, out_schema) -> list[dict]:
        """read(source) -> Arrow tables of `schema` with pipelines.tasks.PART_COL in [0, parts),
        a task per source; each part's rows meet in one task, where write(table) yields record
        batches of `out_schema`; those come back as dicts."""

    @abstractmethod
    def stage_frame(self, df, folder: str) -> int:
        """Each partition of this engine's DataFrame `df` written as `folder/part-NNNNN.parquet`
        by the engine's own tasks (rows never reach the driver); rows written."""

    def table_frame(self, src):
        """The DataFrame of `src.table` or `src.query` (a Spark catalog table or SQL), analysed
        now: a missing table is one line before any job runs."""
        raise ConfigError(f"pipelines.source.format = 'table' needs the Spark engine, not {self.name}")

    # -- scoring (serving.score) -------------------------------------------------------------

    @abstractmethod
    def run_units(self, tasks: list) -> list[dict]:
        """serving.worker.score_unit of every serving.worker.UnitTask; their ledger entries
        (a unit's error as an entry with "error"). A retried task skips what its job committed."""

    # -- training (training.job, training.restarts, training.sweeps) -----------------------

    @abstractmethod
    def check_capacity(self, world_size: int, setting: str = "training.world_size") -> None:
        """Refuse, in one line naming `setting`, a job of `world_size` ranks the engine cannot
        run at once (task slots, workers), before anything of the job starts."""

    @abstractmethod
    def launch_ranks(self, fn: Callable[[int, int, Any], Any], payload: Any, world_size: int, timeout_s: float, *,
                     guard=None, code=None, relaunch: bool = False, workers: Sequence[str] | None = None) -> list:
        """fn(rank, world_size, payload) on `world_size` ranks in one process group
        (training.launchers.run_in_group); their results by rank, or
        training.launchers.TrainingFailed naming the rank that failed or was lost.
        guard: the driver's guard (training.launchers.guard); code: the job's code snapshot,
        shipped and made current in every rank; relaunch: the job's ranks were lost and this
        starts them again (an engine may wait for lost workers to come back); workers: the
        places to pin ranks to (a sweep's trial: its group of Slots.workers)."""


def ranks_only(engine: Engine, what: str):
    """The refusal of an engine that runs training ranks only (the local processes)."""
    return ConfigError(f"{what} needs the tasks of Spark or Dask; the {engine.name} engine runs training ranks only")
