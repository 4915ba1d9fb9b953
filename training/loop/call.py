"""A function written for torchrun or TorchDistributor, run on a rank by `shardline.distribute`.

The function travels as a loop does (training.loop.function: by import path with its
package in the job's code snapshot, or by value with cloudpickle), its arguments by value
(cloudpickle, as TorchDistributor sends them). On each rank it runs with torchrun's
variables exported and no process group joined for it (launchers.torchrun_env): it joins
the group itself. `shardline.context()` gives it the rank's context, made at that call
(training.loop.current); its return value goes back by value too.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .function import LoopFunction

if TYPE_CHECKING:
    from .context import LoopContext
    from .runner import RankJob


@dataclass(frozen=True)
class FunctionCall:
    """The function (`fn`), its arguments (`arguments`: cloudpickle of (args, kwargs)), and
    whether the job has a checkpoint folder its context saves into (`checkpoints`)."""

    fn: LoopFunction
    arguments: bytes
    checkpoints: bool = False


def run_call(rank: int, world_size: int, job: RankJob) -> dict:
    """The rank function of a `shardline.distribute` job: the function's value on rank 0
    (cloudpickle bytes: a class defined in a notebook comes back too), and on every rank the
    MLflow calls its context kept (none: distribute opens no run)."""
    import cloudpickle

    from ..checkpoints.store import CheckpointStore
    from .current import entered, made

    call = job.call
    if call.checkpoints:
        CheckpointStore(job.cfg.checkpoint_dir).announce(rank)  # which host and pid: a lost rank's line names it
    fn = call.fn.load(job.cfg.code_paths)
    args, kwargs = cloudpickle.loads(call.arguments)
    with entered(lambda: _context(rank, world_size, job)), _groups_outlive_the_call():
        value = fn(*args, **kwargs)
        ctx = made()
        pending = ctx.finish() if ctx is not None else []
    return {"value": cloudpickle.dumps(value) if rank == 0 else None, "mlflow_pending": pending}


@contextmanager
def _groups_outlive_the_call() -> Iterator[None]:
    """Every process group the function destroys is kept alive until it has returned.

    A torchrun script commonly ends `dist.destroy_process_group(); return value` with its
    DDP model still a local: the model is freed as the function returns, and its Reducer
    holds the last reference to the gloo group, whose destructor then joins gloo's worker
    threads with the GIL held, while a worker finishing its last allreduce waits for the
    GIL (seen here: a rank hung for good at the end of a TorchDistributor function;
    pytorch/pytorch#56297). Kept here, the group is released after the call through its own
    Python binding, which lets go of the GIL first."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    kept: list = []
    original = distributed_c10d.destroy_process_group

    def destroy_process_group(group=None):
        kept.append(group if group is not None else distributed_c10d.GroupMember.WORLD)
        return original(group)

    dist.destroy_process_group = distributed_c10d.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.destroy_process_group = distributed_c10d.destroy_process_group = original
        kept.clear()


def _context(rank: int, world_size: int, job: RankJob) -> LoopContext:
    """The rank's context, at the function's first `shardline.context()`: in the group the
    function joined, else in the one joined here from torchrun's variables."""
    import torch.distributed as dist

    from .. import collectives, placement
    from ..checkpoints.store import CheckpointStore
    from .context import LoopContext

    if not dist.is_initialized():
        dist.init_process_group(collectives.backend(), init_method="env://", rank=rank, world_size=world_size,
                                timeout=dt.timedelta(seconds=job.cfg.timeout_s))
    store = CheckpointStore(job.cfg.checkpoint_dir) if job.call.checkpoints else None
    slot = placement.here()
    return LoopContext(rank, world_size, job, None, store, collectives.device(), slot.local_rank if slot else rank)
