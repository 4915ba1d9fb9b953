"""`shardline bench strategies`: every parallel strategy on one transformer, side by side.

Each row runs the same rank function, `strategy_rank`, on local processes (gloo):
the seeded FeatureTransformer (`D_MODEL`, `HEADS`, `LAYERS`), the strategy's
`setup` with AdamW, synthetic batches of one global size, `warmup` steps, then
`steps` timed steps. The baseline, measured in the same run, is single-process
training of the same model on the same global batches (`single`); every row's
samples/s is also given as a ratio to it. On a machine with fewer cores than
ranks the ranks share cores, so a ratio below 1 there says "oversubscribed", not
"slow strategy": the table prints the cores beside the ranks.

- samples/s: global batch x timed steps / the slowest rank's wall time for them
  (async PS workers do not step together; the slowest finishes the work).
- peak memory per rank: on CUDA, torch.cuda.max_memory_allocated; on CPU, the
  process's peak RSS from just before the model is built to the end of the timed
  steps (the kernel's high-water mark, reset there: /proc/self/clear_refs), as the
  total (`peak_total_mb_per_rank`) and as its growth over the RSS at that moment
  (`peak_mb_per_rank`): what the strategy's share of model, gradients, optimizer
  state, activations and buffers cost on top of an idle rank with torch imported.
  `peak_vs_ddp` compares the growth: the idle rank's few hundred MB of code and
  libraries are the same for every strategy and would only pull every ratio towards 1
  (`peak_total_vs_ddp` gives the totals' ratio too).
- pipeline bubble, three figures (mean over the pipeline's ranks and the timed steps):
  measured on torch's executor (1 - a rank's compute time / the step's span); predicted by
  replaying the schedule with the same steps' measured action times, communication free;
  and the schedule's own with equal stages ((p-1)/(m+p-1) for GPipe and 1F1B). formula ->
  predicted is what unequal and varying stage times cost, predicted -> measured what the
  replay leaves out: ranks waiting for a core (measured too: pipeline_cpu_wait, the share of
  the step a rank was ready to run but had no core, outside its actions), sends, receives
  and the executor between actions (training/strategies/pipeline_timing.py).
"""

from __future__ import annotations

import ctypes
import os
import resource
import time
from typing import Any

from shardline.engines.local.launch import launch_local
from shardline.training.config import TrainingConfig

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs);
# training.models.builtin (imports torch); training.strategies (imports torch).

D_MODEL, HEADS, LAYERS = 64, 4, 4
N_NUMERIC, CARDINALITIES, CLASSES = 16, [8, 8], 3
GLOBAL_BATCH = 256

# name -> (world size, TrainingConfig settings). `single` is the baseline.
CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "single": (1, {"strategy": "ddp"}),
    "ddp": (2, {"strategy": "ddp"}),
    "ps-sync": (3, {"strategy": "ps", "ps": {"servers": 1}}),
    "ps-async": (3, {"strategy": "ps", "ps": {"servers": 1, "mode": "async", "staleness": 2}}),
    "pipeline-gpipe": (2, {"strategy": "pipeline", "pipeline": {"schedule": "gpipe", "micro_batches": 4}}),
    "pipeline-1f1b": (2, {"strategy": "pipeline", "pipeline": {"schedule": "1f1b", "micro_batches": 4}}),
    "pipeline-interleaved": (2, {"strategy": "pipeline", "pipeline": {"schedule": "interleaved-1f1b",
                                                                      "micro_batches": 4}}),
    "pipeline-zbv": (2, {"strategy": "pipeline", "pipeline": {"schedule": "zbv", "micro_batches": 4}}),
    "tensor": (2, {"strategy": "tensor"}),
    "dp2xtp2": (4, {"strategy": "tensor", "mesh": {"dp_shard": 2, "tp": 2}}),
    "fsdp": (2, {"strategy": "fsdp"}),
    "hsdp2x2": (4, {"strategy": "fsdp", "mesh": {"dp_replicate": 2, "dp_shard": 2}}),
    "dp2xpp2": (4, {"strategy": "pipeline", "mesh": {"dp_replicate": 2, "pp": 2}, "pipeline": {"micro_batches": 4}}),
}

# Sharding saves memory where the model's state (weights, gradients, AdamW's two
# moments) outweighs the activations, and where there are many layers (FSDP gathers one
# at a time): a deep, wide mlp, one sample one token. 25 x 2048 is 100.8M weights: 403 MB
# each for weights and gradients, 806 MB of moments, per full copy; a unit (one layer) is
# 17 MB, so what FSDP gathers at a time is small beside a rank's shard.
MEMORY_HIDDEN = [2048] * 25
# Few steps of a small batch: the peak comes with the first optimizer step (AdamW's moments).
MEMORY_STEPS, MEMORY_WARMUP, MEMORY_BATCH = 2, 1, 64
# On CPU the figure is peak RSS, and glibc keeps freed blocks: FSDP's per-layer gathers
# (allocated and freed every step) would then count as held. Large blocks mmapped, and
# so returned the moment they are freed, make peak RSS follow live memory, as CUDA's
# max_memory_allocated does. Set in each rank with mallopt (ranks are forked from a fork
# server whose malloc read its environment long before: MALLOC_MMAP_THRESHOLD_ set for the
# launch would not reach them).
MMAP_THRESHOLD = 65536
MEMORY_CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "ddp": (4, {"strategy": "ddp"}),
    "fsdp": (4, {"strategy": "fsdp"}),
    "hsdp2x2": (4, {"strategy": "fsdp", "mesh": {"dp_replicate": 2, "dp_shard": 2}}),
}


def _batches(n: int, batch: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        num = torch.randn(batch, N_NUMERIC, generator=g)
        cat = torch.stack([torch.randint(0, c + 1, (batch,), generator=g) for c in CARDINALITIES], 1)
        yield torch.cat([num, cat.float()], 1), torch.randint(0, CLASSES, (batch,), generator=g)


def _status_mb(field: str) -> float:
    """A figure of /proc/self/status (VmRSS, VmHWM, VmSize ...) in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak_rss() -> float:
    """Reset this process's RSS high-water mark (VmHWM, ru_maxrss) to its RSS now; that RSS, MB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def return_freed_memory() -> None:
    """glibc: serve blocks of MMAP_THRESHOLD bytes and more with mmap, so that freeing one
    returns it to the system at once (peak RSS then follows live memory)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def _peak_mb(device, rss_before: float) -> tuple[float, float]:
    """(growth, total) of this rank's peak memory in MB: CUDA's allocated peak on a GPU (both
    the same), else the process's peak RSS since `reset_peak_rss` and its growth over `rss_before`."""
    import torch

    if device.type == "cuda":
        peak = total = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        total = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # VmHWM, since the reset
        peak = max(0.0, total - rss_before)
    return peak, total


def strategy_rank(rank: int, world_size: int, p: dict) -> dict:
    import torch

    from shardline.training.models.builtin import FeatureTransformer, TabularMLP
    from shardline.training.strategies import strategy_for

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    shape = p.get("model") or {"model": "transformer", "hidden": [D_MODEL] * LAYERS, "heads": HEADS}
    # The bench measures the pipeline's bubble: timing on (a training run has it off).
    settings = dict(p["settings"])
    settings["pipeline"] = {**settings.get("pipeline", {}), "timing": True}
    cfg = TrainingConfig(world_size=world_size, batch_size=p["global_batch"], **shape, **settings)
    # The strategy's modules first: importing FSDP2's or DTensor's adds 35-50 MB of RSS,
    # which is code, not what the strategy's training holds.
    strategy = strategy_for(cfg)
    if p.get("return_freed"):
        return_freed_memory()

    def build():  # the seeded plain model, as the worker builds it (fsdp: sharded, from meta)
        torch.manual_seed(0)
        if cfg.model == "transformer":
            return FeatureTransformer(N_NUMERIC, CARDINALITIES, cfg.hidden[0], cfg.heads, len(cfg.hidden), CLASSES)
        return TabularMLP(N_NUMERIC, CARDINALITIES, cfg.hidden, CLASSES, embedding_dim=cfg.embedding_dim)

    with torch.device("meta"):  # the check reads the model's structure only
        strategy.check(cfg, build())
    rss_before = reset_peak_rss() if not cuda else 0.0
    parallel = strategy.setup(
        strategy.model_for(build, device), cfg, rank, world_size, device,
        lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    local = p["global_batch"] // parallel.data_world
    part = slice((parallel.data_rank or 0) * local, ((parallel.data_rank or 0) + 1) * local)

    def run(batches) -> None:
        for x, y in batches:
            if parallel.data_rank is None:
                parallel.step(None, None)
            else:
                parallel.step(x[part].to(device), y[part].to(device))

    run(_batches(p["warmup"], p["global_batch"], seed=1))
    parallel.epoch_metrics()  # forget the warm-up's figures
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    run(_batches(p["steps"], p["global_batch"], seed=2))
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    parallel.close()
    figures = parallel.epoch_metrics()
    peak, total = _peak_mb(device, rss_before)
    return {"rank": rank, "elapsed_s": elapsed, "peak_mb": peak, "peak_total_mb": total,
            "base_mb": rss_before, "figures": figures}


def _measure(name: str, world: int, settings: dict, p: dict, progress) -> dict:
    """One row: `world` ranks of strategy_rank."""
    progress(f"{name}: {world} rank(s), {p['warmup']} warm-up + {p['steps']} timed steps")
    ranks = launch_local(strategy_rank, {**p, "settings": settings}, world_size=world,
                         timeout_s=p.get("timeout_s", 900))
    slowest = max(r["elapsed_s"] for r in ranks)
    row = {
        "world_size": world,
        "settings": settings,
        "samples_per_s": p["global_batch"] * p["steps"] / slowest,
        "peak_mb_per_rank": [round(r["peak_mb"], 1) for r in ranks],
        "peak_total_mb_per_rank": [round(r["peak_total_mb"], 1) for r in ranks],
        "base_mb_per_rank": [round(r["base_mb"], 1) for r in ranks],
    }
    if "pipeline_bubble" in ranks[0]["figures"]:
        for k in ("pipeline_bubble", "pipeline_bubble_predicted", "pipeline_cpu_wait"):
            row[k] = sum(r["figures"][k] for r in ranks) / len(ranks)
        row["pipeline_bubble_formula"] = ranks[0]["figures"]["pipeline_bubble_formula"]
        row["pipeline_activations_held_max"] = [r["figures"]["pipeline_activations_held_max"] for r in ranks]
    staleness = [r["figures"]["ps_staleness_max"] for r in ranks if "ps_staleness_max" in r["figures"]]
    if staleness:
        row["ps_staleness_max"] = max(staleness)
    return row


def run(progress=print, steps: int = 30, warmup: int = 5, global_batch: int = GLOBAL_BATCH,
        only: list[str] | None = None, memory_hidden: list[int] | None = None, timeout_s: float = 900) -> dict:
    """Every strategy on the transformer; then DDP, FSDP and HSDP on the memory model
    (an mlp of `memory_hidden` widths, MEMORY_HIDDEN by default), peak memory vs DDP's.
    only: the transformer's rows to run (with `single`); [] runs the memory rows alone.
    timeout_s: how long a rank may wait in one collective before the row fails."""
    import torch

    p = {"steps": steps, "warmup": warmup, "global_batch": global_batch, "timeout_s": timeout_s}
    names = [n for n in CONFIGS if only is None or n in only or n == "single"] if only != [] else []
    rows = {name: _measure(name, *CONFIGS[name], p, progress) for name in names}
    for row in rows.values():
        row["ratio_vs_single"] = row["samples_per_s"] / rows["single"]["samples_per_s"]

    hidden = memory_hidden or MEMORY_HIDDEN
    mp = {"steps": MEMORY_STEPS, "warmup": MEMORY_WARMUP, "global_batch": MEMORY_BATCH,
          "model": {"model": "mlp", "hidden": hidden}, "return_freed": True, "timeout_s": timeout_s}
    memory = {name: _measure(f"memory {name}", *MEMORY_CONFIGS[name], mp, progress) for name in MEMORY_CONFIGS}
    ddp_peak = max(memory["ddp"]["peak_mb_per_rank"])
    ddp_total = max(memory["ddp"]["peak_total_mb_per_rank"])
    for row in memory.values():
        # The rank that grew most against ddp's (the key: growth over the idle rank), and the same for totals.
        row["peak_vs_ddp"] = max(row["peak_mb_per_rank"]) / ddp_peak if ddp_peak else None
        row["peak_total_vs_ddp"] = max(row["peak_total_mb_per_rank"]) / ddp_total if ddp_total else None
    return {
        "benchmark": "strategies",
        "model": {"name": "transformer", "d_model": D_MODEL, "heads": HEADS, "layers": LAYERS},
        "global_batch": global_batch,
        "steps": steps,
        "warmup": warmup,
        "cores": os.cpu_count(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "memory_measure": "cuda max_memory_allocated" if torch.cuda.is_available() else "peak RSS growth",
        "baseline": "single",
        "strategies": rows,
        "memory": {
            "model": {"name": "mlp", "hidden": hidden, "parameters": _mlp_parameters(hidden)},
            "optimizer": "AdamW",
            "global_batch": MEMORY_BATCH,
            "steps": MEMORY_STEPS,
            "warmup": MEMORY_WARMUP,
            "measure": "cuda max_memory_allocated" if torch.cuda.is_available()
            else f"peak RSS growth over the idle rank (peak_vs_ddp; totals: peak_total_vs_ddp), "
                 f"freed memory returned at once (mallopt M_MMAP_THRESHOLD {MMAP_THRESHOLD})",
            "baseline": "ddp",
            "strategies": memory,
        },
    }


def _mlp_parameters(hidden: list[int]) -> int:
    from shardline.training.models.builtin import TabularMLP

    return sum(p.numel() for p in TabularMLP(N_NUMERIC, CARDINALITIES, hidden, CLASSES).parameters())
