"""`shardline bench train --loop`: one hand-written DDP loop, under plain torchrun and as a
shardline loop (`shardline.train(config, loop=fn)`), over the same shards.

The loop (`hand_written_loop`) is what a torchrun user writes: an MLP (`HIDDEN`) wrapped in
`DistributedDataParallel` by hand, AdamW, cross-entropy, one optimizer step per batch. Only
where its batches come from differs:

- torchrun: `python -m torch.distributed.run --nproc_per_node 2 benchmarks/torchrun_loop.py`;
  each rank reads its shards' rows (the same shards shardline's loader gives it) with
  pyarrow into memory before its loop, and cuts shuffled batches from them: the fastest a
  hand-written reader can be, with nothing to wait for once the loop starts;
- shardline: the same loop as a loop function on the local launcher, its batches from
  `ctx.loader("train")` (reading the shards while it trains).

Each side, in ROUNDS rounds of alternating order (the fastest counts): WARMUP steps, then
STEPS timed ones (train_loops.timed_steps: the slowest rank's seconds; data_wait its share
of the steps' seconds spent waiting for a batch, warm-up included). `ratio.vs_torchrun` =
shardline's steps/s / torchrun's, both measured in this run; `per_cpu_vs_torchrun` the same
per CPU-second of the rank processes (less sensitive to other jobs on a shared machine).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from shardline.benchmarks import prepare_with_dask, significant, synthetic_pipeline
from shardline.benchmarks.train_loops import load_average, run_torchrun, timed_steps

HIDDEN = [512, 512]
GLOBAL_BATCH = 256
STEPS = 150
WARMUP = 15
WORLD_SIZE = 2
LR = 1e-3
ROWS = 100_000  # 80 % train: ~40,000 rows a rank, one epoch holds warm-up and timed steps
ROUNDS = 3
TARGET_VS_TORCHRUN = 0.95
SCRIPT = Path(__file__).resolve().parent / "torchrun_loop.py"


def mlp(features: int, classes: int):
    """The user's model, seeded: every rank and both sides start from the same weights."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    widths = [features, *HIDDEN]
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(widths[-1], classes))


def hand_written_loop(model, batches, rank: int, p: dict) -> dict:
    """The loop both sides run: DDP by hand, AdamW, cross-entropy; timed_steps' figures."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=p["lr"])

    def step(x, y) -> None:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    return timed_steps(batches, step, p["warmup"], p["steps"], rank)


def bench_loop(ctx) -> None:
    """The shardline side: the same loop on `ctx.loader`'s batches; rank 0 logs the figures."""
    loader = ctx.loader("train")

    def batches():
        while True:  # epoch after epoch, as long as the steps last
            for x, y in loader:
                yield ctx.to_device(x), ctx.to_device(y)

    model = mlp(ctx.inputs.feature_width, ctx.inputs.output_width)
    out = hand_written_loop(model, batches(), ctx.rank, ctx.args)
    if ctx.rank == 0:
        ctx.log({k: float(out[k]) for k in ("elapsed_s", "data_wait", "cpu_s")}, step=out["steps"])


def torchrun_rank(p: dict) -> dict:
    """The torchrun side, in a process torchrun started: the group from its variables, the
    rank's shards read into memory, then the same loop on shuffled batches cut from them."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=300))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        features, labels, classes = _read_rank_rows(p["dataset_dir"], rank, world)
        local = p["batch_size"] // world

        def batches():
            g = torch.Generator().manual_seed(rank)
            while True:
                order = torch.randperm(len(labels), generator=g)
                for i in range(0, len(order) - local + 1, local):
                    take = order[i : i + local]
                    yield features[take], labels[take]

        out = hand_written_loop(mlp(features.shape[1], classes), batches(), rank, p)
        dist.barrier()
        return {**out, "rank": rank}
    finally:
        dist.destroy_process_group()


def _read_rank_rows(dataset_dir: str, rank: int, world: int):
    """The rank's train rows as tensors: the shards shardline's loader gives the same rank."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from shardline.pipelines.manifest import load_manifest
    from shardline.training.loader.shards import rank_shards
    from shardline.training.models.inputs import ModelInputs

    manifest = load_manifest(dataset_dir)
    label = manifest.feature_spec.label
    xs, ys = [], []
    for shard in rank_shards(manifest.split("train").shards, rank, world):
        table = pq.read_table(Path(dataset_dir) / shard.path, columns=["features", label])
        flat = table.column("features").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        xs.append(flat.astype(np.float32).reshape(table.num_rows, -1))
        ys.append(table.column(label).to_numpy().astype(np.int64))
    classes = ModelInputs.from_manifest(manifest).output_width
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)), classes


def run_shardline(dataset_dir: str, root: Path, payload: dict) -> dict:
    """One shardline run of the loop: `shardline.train` on the local launcher, its figures."""
    import shardline

    config = {
        "pipelines": {"dataset_dir": dataset_dir},
        "training": {"launcher": "local", "world_size": WORLD_SIZE, "batch_size": payload["batch_size"],
                     "threads_per_rank": payload["threads"], "checkpoint_dir": str(root / "checkpoints"),
                     "max_restarts": 0, "loop_args": payload},
        "tracking": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment": "bench-train-loop",
                     "registered_model": "bench-train-loop"},
    }
    return shardline.train(config, loop=bench_loop).metrics


def run(rows: int | None = None, workdir: str | None = None, progress=print, *, steps: int = STEPS,
        warmup: int = WARMUP, rounds: int = ROUNDS) -> dict:
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // WORLD_SIZE)
    loads = [load_average()]
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-train-loop-", dir=workdir))
    try:
        manifest = prepare_with_dask(synthetic_pipeline(root, rows or ROWS, partitions=2, world_size=WORLD_SIZE),
                                     progress)
        dataset_dir = str((root / "dataset").resolve())
        payload = {"dataset_dir": dataset_dir, "batch_size": GLOBAL_BATCH, "warmup": warmup, "steps": steps,
                   "lr": LR, "threads": threads}
        runs: dict[str, list[dict]] = {"shardline": [], "torchrun": []}
        for i in range(rounds):
            for side in (("shardline", "torchrun") if i % 2 == 0 else ("torchrun", "shardline")):
                progress(f"round {i + 1}/{rounds}: {side}")
                runs[side].append(run_shardline(dataset_dir, root, payload) if side == "shardline"
                                  else run_torchrun(SCRIPT, payload, WORLD_SIZE)[0])
        loads.append(load_average())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _figures(runs, manifest, steps, warmup, threads, cores, loads)


def _figures(runs: dict[str, list[dict]], manifest, steps: int, warmup: int, threads: int, cores: int,
             loads: list[float]) -> dict:
    from shardline.training.models.inputs import ModelInputs

    best = {side: min(rs, key=lambda r: r["elapsed_s"]) for side, rs in runs.items()}
    rate = {side: significant(steps / r["elapsed_s"]) for side, r in best.items()}
    per_cpu = {side: significant(steps / r["cpu_s"]) for side, r in best.items()}
    ratio = significant(rate["shardline"] / rate["torchrun"])
    return {
        "world_size": WORLD_SIZE, "threads_per_rank": threads, "cores": cores, "hidden": HIDDEN,
        "global_batch": GLOBAL_BATCH, "steps": steps, "warmup": warmup, "rounds": len(runs["shardline"]),
        "train_rows": manifest.split("train").rows, "feature_width": ModelInputs.from_manifest(manifest).feature_width,
        "steps_per_s": rate,
        "steps_per_cpu_s": per_cpu,
        "data_wait": {side: significant(r["data_wait"]) for side, r in best.items()},
        "every_round_steps_per_s": {side: [significant(steps / r["elapsed_s"]) for r in rs] for side, rs in runs.items()},
        "ratio": {"vs_torchrun": ratio,
                  "per_cpu_vs_torchrun": significant(per_cpu["shardline"] / per_cpu["torchrun"])},
        "target": {"vs_torchrun": TARGET_VS_TORCHRUN},
        "met": {"vs_torchrun": ratio >= TARGET_VS_TORCHRUN},
        "load_average": loads,
        "measured_at": time.strftime("%Y-%m-%d %H:%M"),
    }
