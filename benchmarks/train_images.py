"""`shardline bench train --images`: training a CNN on PNG files, shardline vs torchvision.

One run, one machine, 2 ranks of DDP on gloo, the same generated PNG images (3 x 64 x 64
in class folders), the same CNN (benchmarks/bench_cnn.py), AdamW, global batch and steps:

- shardline: the images prepared on Spark (images source), `shardline plan` (training.plan:
  measure, choose the layout), the shards prepared again by the plan (`prepare --plan`),
  then the plan's loader workers feeding `ShardLoader` batches to the ddp strategy's step,
  launched by the local launcher (`shardline_local`) and as a Spark barrier stage
  (`shardline_spark`). The same on a deliberately bad layout (`shardline_bad_layout`: one
  row group per shard, the tabular default of 16,384 rows, one loader worker): a rank
  decodes its whole shard before its first batch.
- torchvision: `ImageFolder` + `PILToTensor` + `DistributedSampler` + `DataLoader(num_workers=w)`
  + DDP under torchrun (benchmarks/torchvision_ddp.py), reading the raw files; run for every
  w in NUM_WORKERS, the best kept (all reported: `torchvision_by_workers`).

Each side runs WARMUP steps, then STEPS timed ones (train_loops.timed_steps): images/s =
global batch x STEPS / the slowest rank's seconds; data_wait = the share of all its steps'
seconds, warm-up included (an epoch's start is where a bad layout waits), the slowest rank
waited for its batch. The images are one epoch's worth, so every image is
decoded once on both sides. `ratio.vs_torchvision` = shardline_local / the best torchvision.
Images per CPU-second: the same images over the CPU seconds of every rank process, its
threads and its DataLoader workers: the work done, less sensitive than wall seconds to
other jobs on a shared machine (`ratio.per_cpu_vs_torchvision`).

The legs run in ROUNDS rounds in alternating order (ABBA: other jobs' load drifts, and hits
both sides alike); each leg's fastest round counts, every round is reported. Round 1 tries
every num_workers and the bad layout; later rounds the best num_workers so far.

Beside it (not a target): the whole first epoch of a new user, prepare included: shardline's
prepare (by the plan) + the local launch's wall seconds, against the torchrun run's wall
seconds at the best w (it reads the raw files; nothing to prepare).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from shardline.benchmarks import significant
from shardline.benchmarks.loader_images import CLASSES, make_images
from shardline.benchmarks.train_loops import load_average, run_torchrun, shardline_rank
from shardline.engines import SparkEngine
from shardline.engines.local.launch import launch_local
from shardline.engines.spark.launch import launch_spark_barrier
from shardline.foundation.engine_config import SparkConfig
from shardline.foundation.sessions import spark_session
from shardline.pipelines.config import PipelineConfig
from shardline.pipelines.manifest import load_manifest, store_plan
from shardline.training.config import TrainingConfig

# Imported inside the functions that use them: training.plan (imports torch); pipelines.prepare (imports
# pandas).

SHAPE = (3, 64, 64)
WIDTH = 16  # the CNN's first channels
GLOBAL_BATCH = 128
STEPS = 48
WARMUP = 4
WORLD_SIZE = 2
LR = 1e-3
SEED = 0
NUM_WORKERS = (0, 1, 2, 4)  # torchvision's DataLoader workers per rank tried
# The first prepare's row groups, before the plan (a user's first guess for small images),
# and the bad layout's: the tabular default, one row group per shard of these images.
FIRST_ROW_GROUP, BAD_ROW_GROUP = 256, 16_384
TARGET_VS_TORCHVISION, TARGET_DATA_WAIT = 1.0, 0.05
ROUNDS = 2
MODEL = "shardline.benchmarks.bench_cnn:build"


def training_section(global_batch: int) -> dict:
    return {"model": MODEL, "model_args": {"width": WIDTH}, "world_size": WORLD_SIZE,
            "batch_size": global_batch, "lr": LR, "seed": SEED}


def pipeline_section(images_dir: Path, dataset_dir: Path, rows_per_row_group: int) -> dict:
    return {"dataset_dir": str(dataset_dir), "source": {"format": "images", "path": str(images_dir)},
            "features": {"images": {"image": {"shape": list(SHAPE)}}},
            "split": {"train": 1.0, "val": 0.0, "test": 0.0},
            "layout": {"world_size": WORLD_SIZE, "rows_per_row_group": rows_per_row_group}}


def images_needed(global_batch: int, steps: int, warmup: int) -> int:
    """One epoch's worth for warmup + steps, plus 8% for the shards' uneven rows (a rank
    with fewer rows takes fewer steps; hash assignment keeps them within a few %); at least
    what `shardline plan` needs to measure the loader (MIN_LOADER_BATCHES an epoch)."""
    from shardline.training.plan import MIN_LOADER_BATCHES

    return math.ceil(max(steps + warmup, MIN_LOADER_BATCHES + 2) * global_batch * 1.08)


def run(n_images: int | None = None, workdir: str | None = None, progress=print, *, steps: int = STEPS,
        warmup: int = WARMUP, global_batch: int = GLOBAL_BATCH, num_workers=NUM_WORKERS,
        rounds: int = ROUNDS, spark=None) -> dict:
    # One sequence on purpose: prepare, plan, ABBA rounds and figures share a dozen values made on the way.
    from shardline.pipelines.prepare import prepare
    from shardline.training.plan import plan_dataset

    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // WORLD_SIZE)
    n = n_images or images_needed(global_batch, steps, warmup)
    loads = [load_average()]
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-train-images-", dir=workdir))
    try:
        progress(f"generating {n:,} PNG images of {list(SHAPE)} in {len(CLASSES)} class folders")
        images = root / "images"
        make_images(images, n, SHAPE, jpeg=False)
        progress("starting Spark")
        spark = spark or spark_session(SparkConfig())
        engine = SparkEngine(spark)

        def prepared(name: str, rows_per_row_group: int, by_plan: bool = False) -> tuple[str, float]:
            cfg = PipelineConfig.model_validate(pipeline_section(images, root / name, rows_per_row_group))
            start = time.perf_counter()
            prepare(engine, cfg, by_plan=by_plan)
            return cfg.dataset_dir, time.perf_counter() - start

        progress(f"preparing the images (Spark), {FIRST_ROW_GROUP} rows per row group")
        planned_dir, first_prepare_s = prepared("dataset", FIRST_ROW_GROUP)
        progress("shardline plan: measuring the CNN and the loader")
        t_cfg = TrainingConfig.model_validate(training_section(global_batch))
        start = time.perf_counter()
        measured, plan = plan_dataset(t_cfg, planned_dir)
        plan_s = time.perf_counter() - start
        store_plan(planned_dir, measured.version_id, plan)
        progress(f"preparing again by the plan: {plan.rows_per_row_group} rows per row group, "
                 f"{plan.shards_per_rank} shard(s) and {plan.loader_workers_per_rank} loader worker(s) per rank")
        _, prepare_s = prepared("dataset", FIRST_ROW_GROUP, by_plan=True)
        progress(f"preparing the bad layout: {BAD_ROW_GROUP} rows per row group")
        bad_dir, _ = prepared("bad", BAD_ROW_GROUP)
        layouts = {name: _layout(load_manifest(d)) for name, d in (("planned", planned_dir), ("bad", bad_dir))}

        payload = {"training": training_section(global_batch), "threads": threads, "steps": steps,
                   "warmup": warmup, "dataset_dir": str(Path(planned_dir).resolve()),
                   "workers": plan.loader_workers_per_rank}
        bad = {**payload, "dataset_dir": str(Path(bad_dir).resolve()), "workers": 1}
        script = Path(__file__).with_name("torchvision_ddp.py")

        def launched(launch, p: dict) -> dict:
            start = time.perf_counter()
            out = launch(p)
            return {**out, "wall_s": time.perf_counter() - start}

        def torchvision(w: int) -> dict:
            out, seconds = run_torchrun(script, {
                "images_dir": str(images), "shape": list(SHAPE), "width": WIDTH, "lr": LR,
                "weight_decay": t_cfg.weight_decay, "seed": SEED, "global_batch": global_batch,
                "threads": threads, "steps": steps, "warmup": warmup, "num_workers": w, "epochs": 2,
                "timeout_s": 600}, WORLD_SIZE)
            return {**out, "wall_s": seconds}

        # The local ranks in sessions of their own, as torchrun's (shardline.engines.local.launch).
        local = lambda p: launch_local(shardline_rank, p, WORLD_SIZE)[0]  # noqa: E731
        on_spark = lambda p: launch_spark_barrier(spark, shardline_rank, p, WORLD_SIZE)[0]  # noqa: E731
        runs: dict[str, list[dict]] = {"shardline_local": [], "shardline_spark": [], "shardline_bad_layout": []}
        tv: dict[int, list[dict]] = {w: [] for w in num_workers}
        # Rounds in alternating order (ABBA): load from other jobs on a shared machine drifts,
        # and hits both sides alike; each side's fastest round counts. Round 1 tries every
        # num_workers and the bad layout, later rounds the best num_workers so far.
        for i in range(rounds):
            best_w = max(tv, key=lambda w: _best(tv[w], global_batch)) if i else None
            legs_now = [("shardline_local", lambda: launched(local, payload)),
                        ("shardline_spark", lambda: launched(on_spark, payload))]
            legs_now += [(w, lambda w=w: torchvision(w)) for w in (num_workers if i == 0 else [best_w])]
            if i == 0:
                legs_now.append(("shardline_bad_layout", lambda: launched(local, bad)))
            for name, leg in (legs_now if i % 2 == 0 else legs_now[::-1]):
                progress(f"round {i + 1}/{rounds}: " + (f"torchvision ImageFolder + DataLoader(num_workers={name}) "
                         "+ DDP under torchrun" if isinstance(name, int) else f"{name}, {warmup} + {steps} steps"))
                (tv[name] if isinstance(name, int) else runs[name]).append(leg())
        loads.append(load_average())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def ips(r: dict) -> float:
        return global_batch * r["steps"] / r["elapsed_s"]

    best = max(tv, key=lambda w: _best(tv[w], global_batch))
    legs = {k: min(v, key=lambda r: r["elapsed_s"]) for k, v in runs.items()}
    legs["torchvision"] = min(tv[best], key=lambda r: r["elapsed_s"])
    wall = {k: r["wall_s"] for k, r in legs.items()}
    rates = {k: ips(r) for k, r in legs.items()}
    per_cpu = {k: global_batch * r["steps"] / r["cpu_s"] for k, r in legs.items()}
    ratio = {
        "vs_torchvision": rates["shardline_local"] / rates["torchvision"],
        "per_cpu_vs_torchvision": per_cpu["shardline_local"] / per_cpu["torchvision"],
        "spark_vs_torchvision": rates["shardline_spark"] / rates["torchvision"],
        "bad_layout_vs_planned": rates["shardline_bad_layout"] / rates["shardline_local"],
    }
    ours_first = prepare_s + wall["shardline_local"]
    return {
        "benchmark": "train-images",
        "images": n,
        "image_shape": list(SHAPE),
        "classes": len(CLASSES),
        "model": {"factory": MODEL, "width": WIDTH},
        "world_size": WORLD_SIZE,
        "threads_per_rank": threads,
        "cores": cores,
        "global_batch": global_batch,
        "steps": steps,
        "warmup_steps": warmup,
        "plan": json.loads(plan.model_dump_json()),
        "layouts": layouts,
        "torchvision_num_workers": best,
        "rounds": rounds,
        "images_per_s_by_round": {k: [significant(ips(r)) for r in v] for k, v in runs.items()},
        "torchvision_by_workers": {str(w): significant(_best(r, global_batch)) for w, r in tv.items()},
        "torchvision_by_workers_by_round": {str(w): [significant(ips(x)) for x in r] for w, r in tv.items()},
        "seconds": {k: significant(r["elapsed_s"]) for k, r in legs.items()},
        "images_per_s": {k: significant(v) for k, v in rates.items()},
        "cpu_seconds": {k: significant(r["cpu_s"]) for k, r in legs.items()},
        "images_per_cpu_s": {k: significant(v) for k, v in per_cpu.items()},
        "data_wait": {"planned": significant(legs["shardline_local"]["data_wait"]),
                      "planned_spark": significant(legs["shardline_spark"]["data_wait"]),
                      "bad_layout": significant(legs["shardline_bad_layout"]["data_wait"]),
                      "torchvision": significant(legs["torchvision"]["data_wait"])},
        "ratio": {k: significant(v) for k, v in ratio.items()},
        "targets": {"vs_torchvision": TARGET_VS_TORCHVISION, "data_wait": TARGET_DATA_WAIT},
        "met": {"vs_torchvision": ratio["vs_torchvision"] >= TARGET_VS_TORCHVISION,
                "data_wait": legs["shardline_local"]["data_wait"] <= TARGET_DATA_WAIT},
        "first_epoch": {
            "shardline_s": significant(ours_first), "prepare_s": significant(prepare_s),
            "train_s": significant(wall["shardline_local"]), "torchvision_s": significant(wall["torchvision"]),
            "torchvision_vs_shardline": significant(wall["torchvision"] / ours_first),
            "first_prepare_s": significant(first_prepare_s), "plan_s": significant(plan_s),
        },
        "load_average": loads,
    }


def _best(runs: list[dict], global_batch: int) -> float:
    """Images/s of the fastest of `runs` (contention from other jobs only ever adds time)."""
    return max(global_batch * r["steps"] / r["elapsed_s"] for r in runs)


def _layout(manifest) -> dict:
    train = manifest.split("train")
    return {"train_shards": len(train.shards), "rows_per_row_group": manifest.layout.rows_per_row_group,
            "row_groups": sum(s.row_groups for s in train.shards), "train_rows": train.rows}


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else None), indent=1))
