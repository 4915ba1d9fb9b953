"""The one rank function every launcher calls: build the rank's context, run the job's
loop (the user's, or shardline's own), and give back the rank's result."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardline.foundation.code_travel import UserCode
from shardline.pipelines.manifest import load_manifest

from .. import collectives, placement
from ..checkpoints.store import CheckpointStore
from ..config import TrainingConfig
from ..strategies import Strategy, strategy_for
from .call import FunctionCall, run_call
from .context import LoopContext
from .current import entered
from .function import LoopFunction


@dataclass
class RankJob:
    """Everything a rank needs, made once by the driver's TrainingJob (training.job) and
    pickled to Spark tasks, Dask workers and processes; the same object for every attempt."""

    cfg: TrainingConfig
    dataset_dir: str
    # The job's strategy (its settings and mesh), resolved once on the driver; unset: resolved
    # from cfg when the job is made, so a rank never looks it up.
    strategy: Strategy | None = None
    # The dataset version (manifest number) the driver checked: ranks read it, not a newer one.
    dataset_sequence: int | None = None
    tracking_uri: str | None = None
    run_id: str | None = None
    fingerprint: dict | None = None
    resume_from: str | None = None  # a checkpoint URL; None starts from scratch
    # Rank 0 calls it after each epoch with (epoch, metrics); True stops every rank
    # after that epoch (a sweep's pruner): LoopContext.should_stop. Must pickle, like the rest.
    epoch_hook: Callable[[int, dict[str, float]], bool] | None = None
    # host:port of the driver's progress listener (foundation.progress); None prints here.
    progress_addr: str | None = None
    # The job's snapshot of the user's code (foundation.code_travel): what every rank imports.
    code: UserCode | None = None
    # The user's loop (training.loop, or shardline.train(loop=fn)); None: the built-in loop.
    loop: LoopFunction | None = None
    # A function written for torchrun and its arguments (shardline.distribute): run instead
    # of a loop, with no dataset, joining the process group itself.
    call: FunctionCall | None = None

    def __post_init__(self) -> None:
        if self.strategy is None:
            self.strategy = strategy_for(self.cfg)

    @property
    def socket_ifname(self) -> str | None:
        """What launchers.run_in_group exports as GLOO/NCCL_SOCKET_IFNAME before the group starts."""
        return self.cfg.socket_ifname

    @property
    def ranks_dir(self) -> str | None:
        """Where each rank says who it is (rank-N.json) and, failing with a bug, writes its
        traceback (rank-N.log: launchers.rank_errors); every host can write there. None: a
        distributed function given no checkpoint folder (the ranks write nothing)."""
        if self.call is not None and not self.call.checkpoints:
            return None
        return CheckpointStore(self.cfg.checkpoint_dir).ranks_dir

    @property
    def group_from_env(self) -> bool:
        """The rank function joins the process group itself (launchers.run_in_group)."""
        return self.call is not None


def run_rank(rank: int, world_size: int, job: RankJob) -> dict:
    """The rank function of a training job (see training.launchers): the loop's result on
    rank 0 (metrics, what it registered, MLflow calls kept during an outage, ...); on the
    other ranks only what they must hand the driver (their kept MLflow calls). A
    distributed function's job: its value (training.loop.call)."""
    if job.call is not None:
        return run_call(rank, world_size, job)
    cfg = job.cfg
    torch.set_num_threads(cfg.threads_per_rank)
    device = collectives.device()  # chosen by run_in_group before the group (training.placement)
    manifest = load_manifest(job.dataset_dir, job.dataset_sequence)
    store = CheckpointStore(cfg.checkpoint_dir)
    store.announce(rank)
    slot = placement.here()
    ctx = LoopContext(rank, world_size, job, manifest, store, device, slot.local_rank if slot else rank)
    if job.loop is None:
        from .builtin import train

        loop = train
    else:
        loop = job.loop.load(cfg.code_paths)
    with entered(ctx):  # shardline.context(), for the code the loop calls
        loop(ctx)
    pending = ctx.finish()
    if rank != 0:
        return {"mlflow_pending": pending}
    registered = ctx.registered
    if registered is not None:
        buf = io.BytesIO()
        torch.save(registered.pop("weights"), buf)
        registered["state_dict"] = buf.getvalue()
    return {
        "metrics": ctx.metrics, "stopped_early": ctx.stopped_early, "registered": registered,
        "collective_calls": collectives.calls(),
        # The job's optimizer steps in all (the built-in loop counts them; a user's loop: None):
        # the driver never registers a model that took none.
        "steps": ctx.optimizer_steps,
        # Tracking calls the MLflow server was down for: the driver sends them (mlflow_outage).
        "mlflow_pending": pending,
    }
