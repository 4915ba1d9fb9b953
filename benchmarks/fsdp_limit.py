"""`shardline bench fsdp-limit`: a model that cannot train under ddp within a per-rank
memory limit trains under fsdp with the same limit.

Both runs are 4 local ranks (gloo) of `strategies.strategy_rank` on the memory model
(`strategies.MEMORY_HIDDEN`: a 25 x 2048 mlp, 100.8M weights, AdamW), a warm-up step
and `steps` more. Each rank, once torch, the strategy's modules and the process group
are set up, and before the model is built, limits its own address space (RLIMIT_AS) to
what it has mapped then plus `budget_mb`: every byte the model, its gradients, the
optimizer state, activations and communication buffers add counts against it, and an
allocation beyond it fails (torch raises "can't allocate memory"). Address space, not
RSS: it is what the kernel can enforce on a process without cgroups (not writable
here), and it is the stricter measure (memory mapped but not yet touched counts).

Rough need per rank, fp32: ddp holds the whole model, its gradients (and DDP's
gradient buckets) and AdamW's two moments, about 5 x 403 MB = 2 GB; fsdp at 4 ranks a
quarter of the weights, gradients and moments (400 MB), one gathered layer at a time,
and, on rank 0 while the model is set up, the plain weights it broadcasts (403 MB).
The default budget, 1200 MB, lies between.
"""

from __future__ import annotations

import resource
from typing import Any

from shardline.engines.local.launch import launch_local
from shardline.training.config import TrainingConfig
from shardline.training.launchers import TrainingFailed

from .strategies import MEMORY_HIDDEN, MMAP_THRESHOLD, _mlp_parameters, _status_mb, strategy_rank

# Imported inside the functions that use them: training.models.builtin (imports torch); training.strategies
# (imports torch).

WORLD = 4
BUDGET_MB = 1200
STEPS, GLOBAL_BATCH = 2, 64


def limited_rank(rank: int, world_size: int, p: dict) -> dict:
    """strategy_rank under RLIMIT_AS = the address space mapped now + p["budget_mb"]."""
    from shardline.training.models.builtin import TabularMLP
    from shardline.training.strategies import strategy_for

    # Its modules (FSDP2, DTensor) mapped before the limit.
    strategy_for(TrainingConfig(world_size=world_size, **p["settings"]))
    base = _status_mb("VmSize")
    limit = int((base + p["budget_mb"]) * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    out = strategy_rank(rank, world_size, p)
    return {**out, "vm_base_mb": base, "limit_mb": limit / 2**20}


def _run_one(strategy: str, p: dict, progress) -> dict[str, Any]:
    progress(f"{strategy}: {WORLD} ranks, each limited to its address space + {p['budget_mb']} MB")
    try:
        ranks = launch_local(limited_rank, {**p, "settings": {"strategy": strategy}}, world_size=WORLD,
                             timeout_s=900)
    except TrainingFailed as e:  # the point, for ddp: a rank could not allocate within the limit
        return {"trained": False, "out_of_memory": "can't allocate memory" in str(e), "error": str(e)}
    return {
        "trained": True,
        "steps": p["warmup"] + p["steps"],
        "peak_mb_per_rank": [round(r["peak_mb"], 1) for r in ranks],
        "peak_total_mb_per_rank": [round(r["peak_total_mb"], 1) for r in ranks],
        "limit_mb_per_rank": [round(r["limit_mb"], 1) for r in ranks],
        "address_space_at_limit_mb_per_rank": [round(r["vm_base_mb"], 1) for r in ranks],
    }


def run(progress=print, budget_mb: int = BUDGET_MB, hidden: list[int] | None = None, steps: int = STEPS) -> dict:
    """ddp, then fsdp, each on WORLD ranks under the same per-rank limit."""
    hidden = hidden or MEMORY_HIDDEN
    p = {"steps": steps, "warmup": 1, "global_batch": GLOBAL_BATCH, "budget_mb": budget_mb,
         "model": {"model": "mlp", "hidden": hidden}, "return_freed": True}
    runs = {strategy: _run_one(strategy, p, progress) for strategy in ("ddp", "fsdp")}
    return {
        "benchmark": "fsdp-limit",
        "world_size": WORLD,
        "model": {"name": "mlp", "hidden": hidden, "parameters": _mlp_parameters(hidden)},
        "optimizer": "AdamW",
        "global_batch": GLOBAL_BATCH,
        "limit": {"kind": "RLIMIT_AS per rank: its address space before the model is built + budget",
                  "budget_mb": budget_mb, "mmap_threshold": MMAP_THRESHOLD},
        "runs": runs,
        # What the run shows: the same limit stops ddp and lets fsdp train.
        "ddp_fails_fsdp_trains": runs["ddp"].get("out_of_memory", False) and runs["fsdp"]["trained"],
    }
