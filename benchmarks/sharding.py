"""`shardline bench sharding`: what each layout of 4 ranks holds per rank, on one model.

Five layouts of the same built-in decoder on 4 local ranks (gloo): ddp, fsdp and tensor alone,
and the two combined meshes, dp_shard 2 x tp 2 and pp 2 x tp 2. Each row runs `sharding_rank`:
the seeded decoder (`MODEL`), the layout's strategy `setup` with AdamW, synthetic token
batches of one global size, `warmup` steps (the first one allocates AdamW's moments: the
peak), then `steps` timed steps.

The model is sized so that DDP's copy (weights, gradients, DDP's gradient buckets, AdamW's two
moments: about 5 x the weights) is the largest part of a rank's memory, and so that the parts
tensor parallel leaves whole (the token embedding and the LM head, vocabulary x d_model each)
are a large share of it: what a layout does with them decides its figure.

- peak memory per rank: on CUDA torch.cuda.max_memory_allocated; on CPU the process's peak
  RSS growth from just before the model is built to the end of the timed steps, freed blocks
  returned at once (strategies.reset_peak_rss, return_freed_memory: as `bench strategies`).
- step time: the slowest rank's wall time for the timed steps / steps.
- checks: each combined layout's largest per-rank peak against FSDP's (at most 1.1 x) and
  below DDP's and tensor parallel's, the claim of #55 item 5, as measured in this run.
"""

from __future__ import annotations

import os
import resource
import time
from functools import partial
from typing import Any

from .strategies import reset_peak_rss, return_freed_memory

WORLD = 4
# vocab, length, d_model, heads, layers: 8 blocks of 12 x 256^2 weights (6.3M), an embedding
# and a head of 16384 x 256 each (8.4M together, whole under tensor parallel), 14.7M in all:
# 59 MB of fp32 weights, ~300 MB a DDP rank holds with gradients, buckets and moments.
MODEL = {"vocab": 16384, "length": 16, "d_model": 256, "heads": 8, "layers": 8}
GLOBAL_BATCH, STEPS, WARMUP = 8, 3, 1
MICRO_BATCHES = 4  # pp x tp: 4 micro-batches of the global batch's 8 sequences (1F1B: the last stage holds one)

# name -> TrainingConfig settings on WORLD ranks.
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "tensor": {"strategy": "tensor"},
    "dp_shard x tp": {"mesh": {"dp_shard": 2, "tp": 2}},
    "pp x tp": {"mesh": {"pp": 2, "tp": 2}, "pipeline": {"micro_batches": MICRO_BATCHES}},
}
COMBINED = ("dp_shard x tp", "pp x tp")
WITHIN_FSDP = 1.1  # a combined layout's peak per rank may be at most this x FSDP's alone


def _tokens(n: int, batch: int, model: dict, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        tokens = torch.randint(0, model["vocab"], (batch, model["length"]), generator=g, dtype=torch.int32)
        yield {"tokens": tokens}, tokens.long()


def sharding_rank(rank: int, world_size: int, p: dict) -> dict:
    import torch

    from shardline.training.config import TrainingConfig
    from shardline.training.models.decoder import Decoder
    from shardline.training.strategies import strategy_for
    from shardline.training.task import batch_sums

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    m = p["model"]
    cfg = TrainingConfig(world_size=world_size, batch_size=p["global_batch"], model="decoder", loss="next_token",
                         hidden=[m["d_model"]] * m["layers"], heads=m["heads"], **p["settings"])
    # The layout's modules first: importing FSDP2's or DTensor's adds tens of MB of RSS,
    # which is code, not what the layout's training holds.
    strategy = strategy_for(cfg)
    return_freed_memory()

    def build():  # the seeded plain model, as the worker builds it (sharded layouts: on meta first)
        torch.manual_seed(0)
        return Decoder(m["vocab"], m["length"], m["d_model"], m["heads"], m["layers"])

    with torch.device("meta"):  # the check reads the model's structure only
        strategy.check(cfg, build())
    rss_before = reset_peak_rss() if not cuda else 0.0
    parallel = strategy.setup(strategy.model_for(build, device), cfg, rank, world_size, device,
                              lambda params: torch.optim.AdamW(params, lr=1e-3))
    local = p["global_batch"] // parallel.data_world
    part = slice(parallel.data_rank * local, (parallel.data_rank + 1) * local)

    def run(batches) -> None:
        for x, y in batches:  # as the built-in loop steps: the figures' sums, not the outputs, kept
            parallel.step_sums({k: v[part].to(device) for k, v in x.items()}, y[part].to(device),
                               partial(batch_sums, "next_token"))

    run(_tokens(p["warmup"], p["global_batch"], m, seed=1))
    start = time.perf_counter()
    run(_tokens(p["steps"], p["global_batch"], m, seed=2))
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if cuda:
        peak = total = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        total = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # VmHWM, since the reset
        peak = max(0.0, total - rss_before)
    return {"elapsed_s": elapsed, "peak_mb": peak, "peak_total_mb": total}


def _measure(name: str, settings: dict, p: dict, progress) -> dict:
    from shardline.engines.local.launch import launch_local

    progress(f"{name}: {WORLD} ranks, {p['warmup']} warm-up + {p['steps']} timed steps")
    ranks = launch_local(sharding_rank, {**p, "settings": settings}, world_size=WORLD, timeout_s=900)
    slowest = max(r["elapsed_s"] for r in ranks)
    return {
        "settings": settings,
        "peak_mb_per_rank": [round(r["peak_mb"], 1) for r in ranks],
        "peak_total_mb_per_rank": [round(r["peak_total_mb"], 1) for r in ranks],
        "step_s": slowest / p["steps"],
    }


def run(progress=print, steps: int = STEPS, warmup: int = WARMUP, model: dict | None = None,
        global_batch: int = GLOBAL_BATCH) -> dict:
    """Every layout on the model (MODEL unless given), then the checks."""
    import torch

    m = model or MODEL
    p = {"steps": steps, "warmup": warmup, "global_batch": global_batch, "model": m}
    rows = {name: _measure(name, settings, p, progress) for name, settings in LAYOUTS.items()}
    peak = {name: max(row["peak_mb_per_rank"]) for name, row in rows.items()}
    for row, name in ((rows[n], n) for n in rows):
        row["peak_vs_fsdp"] = round(peak[name] / peak["fsdp"], 3) if peak["fsdp"] else None
        row["peak_vs_ddp"] = round(peak[name] / peak["ddp"], 3) if peak["ddp"] else None
    checks = {
        name: {
            "peak_mb": peak[name], f"within_{WITHIN_FSDP}x_fsdp": peak[name] <= WITHIN_FSDP * peak["fsdp"],
            "below_ddp": peak[name] < peak["ddp"], "below_tensor": peak[name] < peak["tensor"],
        }
        for name in COMBINED
    }
    return {
        "benchmark": "sharding",
        "model": {"name": "decoder", **m, "parameters": _parameters(m)},
        "world_size": WORLD,
        "global_batch": global_batch,
        "steps": steps,
        "warmup": warmup,
        "cores": os.cpu_count(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "memory_measure": "cuda max_memory_allocated" if torch.cuda.is_available()
        else "peak RSS growth over the idle rank, freed memory returned at once",
        "layouts": rows,
        "checks": checks,
        "all_checks_met": all(v for c in checks.values() for k, v in c.items() if k != "peak_mb"),
    }


def _parameters(m: dict) -> int:
    import torch

    from shardline.training.models.decoder import Decoder

    with torch.device("meta"):
        model = Decoder(m["vocab"], m["length"], m["d_model"], m["heads"], m["layers"])
    return sum(p.numel() for p in model.parameters())
