"""Training functions as a TorchDistributor user writes them: they read torchrun's environment
and join the process group themselves. Nothing here imports shardline but `checkpointed`, which
reaches shardline's checkpoints through `shardline.context()` when run by `shardline.distribute`."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a step: drawn from the step and rank alone, so a restarted
    function reads the same batches without keeping a generator."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(16, 1, generator=g)


def one_step(model, opt, step: int, rank: int) -> float:
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def train_linear(steps: int, lr: float = 0.05) -> dict:
    """DDP of a linear model for `steps` steps; the same value on every rank (the trained
    weights, the world size, which of torchrun's variables were set)."""
    dist.init_process_group("gloo")  # init_method env://, as under torchrun
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        one_step(model, opt, step, dist.get_rank())
    out = {"weights": {k: v.tolist() for k, v in model.module.state_dict().items()}, "world": world,
           "env": [k for k in ENV if k in os.environ]}
    dist.destroy_process_group()
    return out


def checkpointed(steps: int, save_every: int, checkpoint: str | None = None, pause_s: float = 0.0) -> dict:
    """`train_linear` that survives a lost rank. `checkpoint` None: through shardline's
    context (ctx.save / ctx.restore: DCP, the checkpoint store); else through its own file,
    which the restarted function finds. Leaves the group open (shardline closes it)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = {"model": model, "opt": opt, "progress": {"step": 0}}
    if checkpoint is None:
        import shardline

        ctx = shardline.context()
        ctx.restore(state)
    elif os.path.exists(checkpoint):
        saved = torch.load(checkpoint, weights_only=True)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state["progress"]["step"] = saved["step"]
    step = state["progress"]["step"]
    while step < steps:
        one_step(model, opt, step, rank)
        step += 1
        state["progress"]["step"] = step
        if step % save_every == 0:
            if checkpoint is None:
                ctx.save(state, step=step)
            else:
                dist.barrier()  # every rank took the step before rank 0 writes it down
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               checkpoint + ".tmp")
                    os.replace(checkpoint + ".tmp", checkpoint)
                dist.barrier()
        time.sleep(pause_s)  # room for a test to kill a rank mid-run
    return {k: v.tolist() for k, v in model.module.state_dict().items()}
