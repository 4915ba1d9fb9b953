"""`shardline bench train`: our Spark-barrier DDP vs plain torchrun, TorchDistributor and raw all-reduce.

One run, one prepared synthetic dataset, one model (an MLP, `HIDDEN`), two ranks on
gloo. Every figure comes from the same rank function, `ddp_rank`: it reads its
shards (training.loader.shards.rank_shards) with pyarrow into tensors, builds the model
with training.models.builtin.build_model, wraps it with the "ddp" strategy and times a
fixed number of optimizer steps. Only the launcher around it changes:

- step time: `launch_spark_barrier` (ours) vs `python -m torch.distributed.run
  --nproc_per_node 2 benchmarks/torchrun_ddp.py` (the plain torchrun baseline).
  Step time = mean wall time of one step (zero_grad, forward, backward with its
  all-reduce, optimizer step) on rank 0, after `warmup` steps. Each launcher runs
  `rounds` times in ABBA order; the fastest round of each is compared (on a shared
  machine, load from elsewhere only adds time), every round is reported.
- launch to first step: wall time from calling the launcher to the end of rank 0's
  first step, for `launch_spark_barrier` vs `pyspark.ml.torch.distributor.
  TorchDistributor(num_processes=2, local_mode=False)` on the same warm Spark
  session. Both get a short run of the same function (TorchDistributor's ranks
  join the group from the environment it sets). Ours runs in Spark's reused Python
  workers (torch already imported); TorchDistributor starts torchrun and fresh
  processes every time: that difference is what it measures. torchrun's figure is
  reported too, taken from its step-time rounds (the first step does not depend on
  how many follow).
- all-reduce: inside our DDP (Spark run, after its step-time steps, so the hook
  never slows those), a comm hook wrapping DDP's default all-reduce times each
  bucket until its future completes, from the moment the later of the two ranks
  issued it (both ranks on one host, one monotonic clock). The union of those
  intervals in a step is its all-reduce time; gradient bytes / its mean is the
  achieved bytes/s. Also reported: the time in flight from each rank's own issue,
  which adds waiting for the slower peer (skew, not bandwidth). The baseline is
  `dist.all_reduce` of one float32 tensor of the same bytes in the same group,
  back to back, `allreduce_iters` times.

Ratios, each > 1 when ours is better:
  step_time_ratio = torchrun_step_s / spark_step_s
  launch_ratio = torch_distributor_launch_s / spark_launch_s
and allreduce_ratio = ddp_bytes_per_s / raw_bytes_per_s (1.0: DDP's all-reduce gets
what a bare all-reduce gets; below 1 it loses to bucketing, the hook path and
backward's compute running beside it on the same cores).
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from shardline.benchmarks import significant, synthetic_pipeline
from shardline.engines import SparkEngine
from shardline.engines.spark.launch import launch_spark_barrier
from shardline.foundation.engine_config import SparkConfig
from shardline.foundation.sessions import spark_session
from shardline.pipelines.manifest import load_manifest
from shardline.training.config import TrainingConfig
from shardline.training.launchers import free_port

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs);
# training.loader.shards (imports torch); training.models.builtin (imports torch); training.strategies
# (imports torch); pyspark (only with a Spark session: Dask and local jobs never import it); pipelines.prepare
# (imports pandas).

HIDDEN = [512, 512]  # big enough that gradients (~1 MB) are not all latency
GLOBAL_BATCH = 512
STEPS = 200
WARMUP = 20
LAUNCH_STEPS = 2  # the launch comparison only needs a first step
ALLREDUCE_ITERS = 100
ROUNDS = 3  # per launcher, alternating; the fastest counts (load elsewhere only adds time)
RESULT_MARK = "SHARDLINE_BENCH_TRAIN "  # torchrun_ddp.py's result line on stdout


# --- the rank function: the same under every launcher --------------------------------

def ddp_rank(rank: int, world_size: int, p: dict) -> dict:
    """Train `p["steps"]` steps of DDP inside an initialised group; return plain figures.

    The model lives only in `_measure`'s frame and is collected before returning:
    a model alive when a Spark barrier task yields made later jobs hang (seen with Spark 4.3).
    """
    out = _measure(rank, world_size, p)
    gc.collect()
    return out


def env_rank(p: dict) -> dict:
    """`ddp_rank` for launchers that set MASTER_ADDR/PORT, RANK, WORLD_SIZE (torchrun, TorchDistributor)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=p.get("timeout_s", 300)))
    try:
        out = ddp_rank(dist.get_rank(), dist.get_world_size(), p)
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def _rank_data(p: dict, rank: int, world_size: int):
    import torch

    from shardline.training.loader.shards import rank_shards

    manifest = load_manifest(p["dataset_dir"])
    label = manifest.feature_spec.label
    xs, ys = [], []
    for s in rank_shards(manifest.split("train").shards, rank, world_size):
        t = pq.read_table(Path(p["dataset_dir"]) / s.path, columns=["features", label])
        feats = t.column("features").combine_chunks()
        # .flatten(), not .values: on a sliced list array .values is the whole parent.
        flat = feats.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
        xs.append(flat.reshape(t.num_rows, -1))
        ys.append(t.column(label).to_numpy().astype(np.int64))
    return manifest, torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def _measure(rank: int, world_size: int, p: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from shardline.training.models.builtin import build_model
    from shardline.training.strategies import strategy_for

    torch.set_num_threads(p["threads"])
    manifest, x, y = _rank_data(p, rank, world_size)
    cfg = TrainingConfig(hidden=p["hidden"], world_size=world_size, batch_size=p["global_batch"])
    parallel = strategy_for(cfg).setup(
        build_model(manifest, cfg), cfg, rank, world_size, torch.device("cpu"),
        lambda params: torch.optim.Adam(params, lr=cfg.lr),
    )
    model, opt = parallel.runner, parallel.optimizer
    local = p["global_batch"] // world_size
    n = len(y) - len(y) % local  # every rank takes the same number of steps, whatever its rows
    if n == 0:
        raise ValueError(f"bench train: rank {rank} has {len(y)} train rows, fewer than its batch {local}")

    def step(i: int) -> float:
        lo = (i * local) % n
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[lo : lo + local]), y[lo : lo + local]).backward()
        opt.step()
        return time.perf_counter() - start

    step(0)
    first_step_at = time.time()  # wall clock: the launcher's caller compares it with its own
    times = [step(i) for i in range(1, p["steps"])]
    measured = times[p["warmup"]:] or times
    out: dict[str, Any] = {
        "rank": rank,
        "first_step_at": first_step_at,
        "step_s": sum(measured) / len(measured),
        "steps_timed": len(measured),
        "local_batch": local,
    }
    if p.get("measure_comm"):
        out.update(_allreduce_figures(model, step, p))
    return out


def _allreduce_figures(model, step, p: dict) -> dict:
    """Achieved all-reduce bytes/s inside DDP (comm hook) vs raw dist.all_reduce, same bytes.

    Each bucket's all-reduce is timed from the hook's call to its future's completion.
    DDP issues buckets in index order on every rank, so the j-th call of a step is the
    same collective on both ranks: its start on the later rank (perf_counter is one
    monotonic clock for the whole host) is when the reduction can really begin.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    grad_bytes = sum(q.numel() * q.element_size() for q in model.parameters() if q.requires_grad)
    starts: list[float] = []
    ends: list[float] = []

    def timed_allreduce(state, bucket):
        j = len(starts)
        starts.append(time.perf_counter())
        ends.append(float("nan"))

        def done(fut):
            ends[j] = time.perf_counter()  # on gloo's thread; DDP waits for it before the step ends
            return fut.value()

        return default_hooks.allreduce_hook(state, bucket).then(done)

    model.register_comm_hook(None, timed_allreduce)
    steps = []
    for i in range(p["steps"]):
        starts.clear()
        ends.clear()
        step(i)
        steps.append((list(starts), list(ends)))
    steps = steps[p["warmup"]:] or steps
    all_starts: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_starts, [s for s, _ in steps])
    in_flight, both_ready = [], []
    for k, (s, e) in enumerate(steps):
        ready = [max(r[k][j] for r in all_starts) for j in range(len(s))]
        in_flight.append(_union(list(zip(s, e))))
        both_ready.append(_union([(a, b) for a, b in zip(ready, e) if b > a]))

    t = torch.ones(grad_bytes // 4, dtype=torch.float32)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(p["allreduce_iters"]):
        dist.all_reduce(t)
    raw_s = (time.perf_counter() - start) / p["allreduce_iters"]
    return {
        "grad_bytes": grad_bytes,
        "buckets": len(steps[0][0]),
        "ddp_comm_s": sum(both_ready) / len(both_ready),
        "ddp_in_flight_s": sum(in_flight) / len(in_flight),
        "raw_allreduce_s": raw_s,
    }


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# --- launchers ------------------------------------------------------------------------

def run_torchrun(payload: dict, world_size: int = 2) -> tuple[dict, float]:
    """Plain torchrun on this machine; (rank 0's result, the caller's start wall time)."""
    script = Path(__file__).with_name("torchrun_ddp.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(world_size), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), json.dumps(payload)]
    env = {**os.environ, "OMP_NUM_THREADS": str(payload["threads"])}
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench train: torchrun failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
    return json.loads(lines[0][len(RESULT_MARK):]), started


def run_spark(spark, payload: dict, world_size: int = 2) -> tuple[dict, float]:
    started = time.time()
    results = launch_spark_barrier(spark, ddp_rank, payload, world_size, payload["timeout_s"])
    return results[0], started


def run_torch_distributor(spark, payload: dict, world_size: int = 2) -> tuple[dict, float]:
    from pyspark.ml.torch.distributor import TorchDistributor

    started = time.time()
    # It takes the active session: the one `spark` is (spark_session returns the active one).
    result = TorchDistributor(num_processes=world_size, local_mode=False, use_gpu=False).run(
        env_rank, payload)
    return result, started


# --- the benchmark --------------------------------------------------------------------

def run(rows: int = 100_000, workdir: str | None = None, progress=print, *, steps: int = STEPS,
        warmup: int = WARMUP, allreduce_iters: int = ALLREDUCE_ITERS,
        hidden: list[int] | None = None, rounds: int = ROUNDS, dataset_dir: str | None = None) -> dict:
    """Run every leg once per round; `dataset_dir` (prepared for 2 ranks) skips preparing `rows`."""
    from shardline.pipelines.prepare import prepare

    world_size = 2
    threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-train-", dir=workdir))
    try:
        cfg = synthetic_pipeline(root, rows, partitions=2, world_size=world_size)
        progress("starting Spark")
        spark = spark_session(SparkConfig())
        if dataset_dir is None:
            progress(f"generating and preparing {rows:,} rows (Spark)")
            prepare(SparkEngine(spark), cfg)
            dataset_dir = cfg.dataset_dir
        manifest = load_manifest(dataset_dir)
        rows = sum(s.rows for s in manifest.splits.values())
        train_rows = manifest.split("train").rows
        payload = {
            "dataset_dir": str(Path(dataset_dir).resolve()),
            "hidden": hidden or HIDDEN,
            "global_batch": GLOBAL_BATCH,
            "steps": steps,
            "warmup": warmup,
            "threads": threads,
            "allreduce_iters": allreduce_iters,
            "measure_comm": True,
            "timeout_s": 300,
        }
        launch = {**payload, "steps": LAUNCH_STEPS, "warmup": 0, "measure_comm": False}

        runs, launch_s = _rounds(spark, payload, launch, rounds, progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    return _figures(runs, launch_s, payload, rows, train_rows, world_size, rounds)


def _rounds(spark, payload: dict, launch: dict, rounds: int,
            progress) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """Both DDP legs `rounds` times (`payload`), then each launcher's seconds from launch to
    first step (`launch`): (every round's figures per leg, launch seconds per launcher)."""
    # ABBA order over the rounds: a neighbour's load on a shared machine hits both alike.
    runs: dict[str, list[dict]] = {"spark": [], "torchrun": []}
    for i in range(rounds):
        for name in (("spark", "torchrun") if i % 2 == 0 else ("torchrun", "spark")):
            progress(f"round {i + 1}/{rounds}: {name} DDP, {payload['steps']} steps"
                     + (", then all-reduce timing" if name == "spark" else ""))
            if name == "spark":
                runs[name].append(run_spark(spark, payload)[0])
            else:
                r, started = run_torchrun({**payload, "measure_comm": False})
                runs[name].append({**r, "launch_s": r["first_step_at"] - started})

    launch_s: dict[str, float] = {}
    for name, fn in (("spark", lambda: run_spark(spark, launch)),
                     ("torch_distributor", lambda: run_torch_distributor(spark, launch))):
        progress(f"launch to first step: {name}")
        r, started = fn()
        launch_s[name] = r["first_step_at"] - started
    launch_s["torchrun"] = min(r["launch_s"] for r in runs["torchrun"])
    return runs, launch_s


def _figures(runs: dict[str, list[dict]], launch_s: dict[str, float], payload: dict, rows: int, train_rows: int,
             world_size: int, rounds: int) -> dict:
    """The benchmark's one JSON object, from the rounds run with `payload`."""
    # The least disturbed round of each: contention only ever adds time.
    step_s = {k: min(r["step_s"] for r in v) for k, v in runs.items()}
    # Floors keep a degenerate timing from turning into an infinite bytes/s (not JSON).
    ddp_comm_s = max(min(r["ddp_comm_s"] for r in runs["spark"]), 1e-9)
    in_flight_s = max(min(r["ddp_in_flight_s"] for r in runs["spark"]), 1e-9)
    raw_s = max(min(r["raw_allreduce_s"] for r in runs["spark"]), 1e-9)
    grad_bytes = runs["spark"][0]["grad_bytes"]
    ddp_bps = grad_bytes / ddp_comm_s
    raw_bps = grad_bytes / raw_s
    return {
        "benchmark": "train",
        "rows": rows,
        "train_rows": train_rows,
        "world_size": world_size,
        "threads_per_rank": payload["threads"],
        "model": {"name": "mlp", "hidden": payload["hidden"], "grad_bytes": grad_bytes},
        "global_batch": GLOBAL_BATCH,
        "steps": payload["steps"],
        "warmup_steps": payload["warmup"],
        "steps_timed": runs["spark"][0]["steps_timed"],
        "rounds": rounds,
        "step_s": {k: significant(v) for k, v in step_s.items()},
        "step_s_by_round": {k: [significant(r["step_s"]) for r in v] for k, v in runs.items()},
        "steps_per_s": {k: significant(1 / v) for k, v in step_s.items()},
        "step_time_ratio": significant(step_s["torchrun"] / step_s["spark"]),
        "launch_to_first_step_s": {k: significant(v) for k, v in launch_s.items()},
        "launch_ratio": significant(launch_s["torch_distributor"] / launch_s["spark"]),
        "allreduce": {
            "bytes": grad_bytes,
            "buckets": runs["spark"][0]["buckets"],
            "ddp_comm_s_per_step": significant(ddp_comm_s),
            "ddp_in_flight_s_per_step": significant(in_flight_s),
            "ddp_in_flight_bytes_per_s": significant(grad_bytes / in_flight_s),
            "raw_allreduce_s": significant(raw_s),
            "ddp_bytes_per_s": significant(ddp_bps),
            "raw_bytes_per_s": significant(raw_bps),
            "raw_iters": payload["allreduce_iters"],
        },
        "allreduce_ratio": significant(ddp_bps / raw_bps),
    }


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)))
