"""What `bench train --images` and `--tokens` share: the timed training loop both sides run
(shardline's ranks and the hand-written torchrun scripts), the torchrun launch, and the
rank function that trains a user's model on shardline's loader under any launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from shardline.pipelines.manifest import load_manifest
from shardline.training.config import TrainingConfig
from shardline.training.launchers import free_port

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs); psutil
# (optional); training.batch (imports torch); training.loader.reader (imports torch); training.models.builtin
# (imports torch); training.strategies (imports torch); training.loop.runner (imports torch).

RESULT_MARK = "SHARDLINE_BENCH_RESULT "  # a torchrun script's result line on stdout


def timed_steps(batches, step, warmup: int, steps: int, rank: int) -> dict:
    """`warmup` untimed steps, a barrier, then `steps` timed ones, each = waiting for the next
    (x, y) from `batches` + `step(x, y)`. Inside a process group; every rank's figures come
    back (gathered), so the caller reports the slowest rank's.

    elapsed: wall seconds of the timed steps on this rank; data_wait: the share of all the
    steps' seconds, warm-up included, spent waiting for batches: an epoch's start (the first
    row groups decoded before the first batch) is where a bad layout waits, and
    training.loop.builtin's data_wait_fraction counts it too; cpu_s: CPU
    seconds of the rank's process, its threads and its child processes (a DataLoader's
    workers) over those steps, summed over the ranks: the work, whatever else the machine
    runs (on a shared machine wall seconds also count the others' load)."""
    import torch.distributed as dist

    it = iter(batches)

    def one() -> tuple[float, float]:
        t = time.perf_counter()
        x, y = next(it)
        got = time.perf_counter()
        step(x, y)
        return got - t, time.perf_counter() - t

    warm = [one() for _ in range(warmup)]
    dist.barrier()  # every rank starts the clock together
    start, cpu = time.perf_counter(), cpu_seconds()
    timed = [one() for _ in range(steps)]
    elapsed = time.perf_counter() - start
    waited, stepping = (sum(w for w, _ in warm + timed), sum(t for _, t in warm + timed))
    mine = {"elapsed_s": elapsed, "data_wait": waited / stepping, "rank": rank, "cpu_s": cpu_seconds() - cpu}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {
        "elapsed_s": max(r["elapsed_s"] for r in every),
        "data_wait": max(r["data_wait"] for r in every),
        "data_wait_by_rank": [r["data_wait"] for r in every],
        "cpu_s": sum(r["cpu_s"] for r in every),
        "steps": steps, "warmup": warmup,
    }


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads) and its live children."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:  # ended between the listing and the reading
            pass
    return total


def run_torchrun(script: Path, payload: dict, world_size: int, timeout_s: float = 900) -> tuple[dict, float]:
    """`script` under plain torchrun on this machine; (rank 0's result, wall seconds from the
    launch to the end of every process)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(world_size), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), json.dumps(payload)]
    env = {**os.environ, "OMP_NUM_THREADS": str(payload["threads"])}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{script.name} under torchrun failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
    return json.loads(lines[0][len(RESULT_MARK):]), wall


def shardline_rank(rank: int, world_size: int, p: dict) -> dict:
    """One rank of shardline's side: the model built as training builds it (build_model from
    the manifest and training config), the ddp strategy's step, ShardLoader batches, epoch
    after epoch until warmup + steps. The model stays in this frame (launchers: a model alive
    when a Spark barrier task yields made later jobs hang)."""
    parallel, batches = ddp_rank(rank, world_size, p)
    return timed_steps(batches, parallel.step, p["warmup"], p["steps"], rank)


def ddp_rank(rank: int, world_size: int, p: dict):
    """A benchmark rank's strategy (`p["training"]`'s, ddp by default: the model built as
    training builds it) and its endless ShardLoader batches, epoch after epoch. Each rank
    runs in a session of its own, as torchrun's (training.launchers.rank_server)."""
    import torch

    from shardline.training.batch import split
    from shardline.training.loader.reader import ShardLoader
    from shardline.training.models.builtin import build_model
    from shardline.training.strategies import strategy_for
    from shardline.training.loop.recipe import make_optimizer

    torch.set_num_threads(p["threads"])
    cfg = TrainingConfig.model_validate(p["training"])
    manifest = load_manifest(p["dataset_dir"])
    parallel = strategy_for(cfg).setup(build_model(manifest, cfg), cfg, rank, world_size,
                                       torch.device("cpu"), lambda params: make_optimizer(params, cfg))
    loader = ShardLoader(manifest, p["dataset_dir"], "train", rank, world_size, cfg.batch_size // world_size,
                         cfg.seed, shuffle_buffer_rows=cfg.shuffle_buffer_rows, workers=p["workers"],
                         prefetch=cfg.prefetch_depth)

    def batches():
        epoch = 0
        while True:
            for batch in loader.epoch(epoch):
                yield split(batch)
            epoch += 1

    return parallel, batches()


def load_average() -> float:
    """The machine's 1-minute load average: printed beside figures measured on a shared machine."""
    return round(os.getloadavg()[0], 2)
