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
    with entered(lambda: _context(rank, world_size, job)):
        value = fn(*args, **kwargs)
        ctx = made()
        pending = ctx.finish() if ctx is not None else []
    return {"value": cloudpickle.dumps(value) if rank == 0 else None, "mlflow_pending": pending}


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
