"""`shardline bench train --tokens`: the built-in decoder on token sequences, shardline vs a
nanoGPT-style loop.

One run, 2 ranks of DDP on gloo, one generated token stream (ids 0..VOCAB-1), the same
decoder (training/models/decoder.py: d_model, blocks, heads below), AdamW, global batch,
sequence length and steps:

- shardline: the stream cut into rows of LENGTH ids (a Parquet `tokens` list<int32>
  column), prepared on Spark as `task = "next_token"`, `shardline plan` run on it and the
  shards prepared again by the plan; the plan's loader workers feed `ShardLoader` batches
  to the ddp strategy's step (the next-token loss), local launcher.
- memmap: the same stream as one uint16 `np.memmap`; every sample a random window of
  LENGTH ids and the same window shifted by one, drawn in the training loop, as nanoGPT's
  `get_batch` (benchmarks/memmap_ddp.py), DDP under torchrun.

Each side, in ROUNDS rounds of alternating order (the fastest counts): WARMUP steps, then STEPS timed ones (train_loops.timed_steps); tokens/s = global
batch x LENGTH x STEPS / the slowest rank's seconds, data_wait the share of them it waited
for batches (over all its steps, warm-up included). `ratio.vs_memmap` = shardline / memmap; `per_cpu_vs_memmap` the same for tokens
per CPU-second of the rank processes (less sensitive to other jobs on a shared machine).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.benchmarks import significant
from shardline.benchmarks.train_images import images_needed
from shardline.benchmarks.train_loops import load_average, run_torchrun, shardline_rank
from shardline.engines import SparkEngine
from shardline.engines.local.launch import launch_local
from shardline.foundation.engine_config import SparkConfig
from shardline.foundation.sessions import spark_session
from shardline.pipelines.config import PipelineConfig
from shardline.pipelines.manifest import load_manifest, store_plan
from shardline.training.config import TrainingConfig

# Imported inside the functions that use them: pipelines.prepare (imports pandas); training.plan (imports
# torch).

VOCAB = 512
LENGTH = 128
D_MODEL, LAYERS, HEADS = 128, 2, 4
GLOBAL_BATCH = 32
STEPS = 30
WARMUP = 3
WORLD_SIZE = 2
LR = 1e-3
SEED = 0
FIRST_ROW_GROUP = 64  # the first prepare's row groups: enough of them for the plan to measure
TARGET_VS_MEMMAP, TARGET_DATA_WAIT = 1.0, 0.05
ROUNDS = 3


def training_section(global_batch: int) -> dict:
    return {"model": "decoder", "hidden": [D_MODEL] * LAYERS, "heads": HEADS, "world_size": WORLD_SIZE,
            "batch_size": global_batch, "lr": LR, "seed": SEED}


def write_tokens(root: Path, rows: int) -> tuple[Path, Path]:
    """The stream as Parquet rows of LENGTH ids (4 files) and as a uint16 memmap file."""
    rng = np.random.default_rng(SEED)
    # Counting runs from random starts: a stream a small model can learn, like text, not noise.
    starts = rng.integers(0, VOCAB, rows)
    stream = ((starts[:, None] + np.arange(LENGTH)) % VOCAB).astype(np.int32)
    parquet = root / "tokens"
    parquet.mkdir(parents=True)
    for i, part in enumerate(np.array_split(np.arange(rows), 4)):
        table = pa.table({"id": pa.array(part, pa.int64()),
                          "tokens": pa.array(list(stream[part]), pa.list_(pa.int32()))})
        pq.write_table(table, parquet / f"part-{i}.parquet")
    memmap = root / "train.bin"
    stream.reshape(-1).astype(np.uint16).tofile(memmap)
    return parquet, memmap


def run(rows: int | None = None, workdir: str | None = None, progress=print, *, steps: int = STEPS,
        warmup: int = WARMUP, global_batch: int = GLOBAL_BATCH, rounds: int = ROUNDS, spark=None) -> dict:
    # One sequence on purpose: prepare, plan, ABBA rounds and figures share a dozen values made on the way.
    from shardline.pipelines.prepare import prepare
    from shardline.training.plan import plan_dataset

    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // WORLD_SIZE)
    # One epoch's worth of rows for warmup + steps, 8% over for the shards' uneven rows
    # (train_images.images_needed: at least what the plan needs to measure).
    rows = rows or images_needed(global_batch, steps, warmup)
    loads = [load_average()]
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-train-tokens-", dir=workdir))
    try:
        progress(f"generating {rows:,} sequences of {LENGTH} token ids (Parquet and a uint16 memmap)")
        parquet, memmap = write_tokens(root, rows)
        progress("starting Spark")
        spark = spark or spark_session(SparkConfig())
        cfg = PipelineConfig.model_validate({
            "dataset_dir": str(root / "dataset"), "source": {"format": "parquet", "path": str(parquet)},
            "features": {"key": "id", "task": "next_token",
                         "tensors": {"tokens": {"dtype": "int32", "shape": [LENGTH], "vocab_size": VOCAB}}},
            "split": {"train": 1.0, "val": 0.0, "test": 0.0},
            "layout": {"world_size": WORLD_SIZE, "rows_per_row_group": FIRST_ROW_GROUP},
        })
        progress("preparing the tokens (Spark, task next_token)")
        prepare(SparkEngine(spark), cfg)
        progress("shardline plan: measuring the decoder and the loader")
        t_cfg = TrainingConfig.model_validate(training_section(global_batch))
        measured, plan = plan_dataset(t_cfg, cfg.dataset_dir)
        store_plan(cfg.dataset_dir, measured.version_id, plan)
        progress(f"preparing again by the plan: {plan.rows_per_row_group} rows per row group")
        start = time.perf_counter()
        prepare(SparkEngine(spark), cfg, by_plan=True)
        prepare_s = time.perf_counter() - start
        train = load_manifest(cfg.dataset_dir).split("train")

        payload = {"training": training_section(global_batch), "threads": threads, "steps": steps,
                   "warmup": warmup, "dataset_dir": str(Path(cfg.dataset_dir).resolve()),
                   "workers": plan.loader_workers_per_rank}
        mm_payload = {"tokens": str(memmap), "length": LENGTH, "vocab": VOCAB, "d_model": D_MODEL,
                      "layers": LAYERS, "heads": HEADS, "lr": LR, "weight_decay": t_cfg.weight_decay,
                      "seed": SEED, "global_batch": global_batch, "threads": threads, "steps": steps,
                      "warmup": warmup, "timeout_s": 600}
        # The local ranks in sessions of their own, as torchrun's (shardline.engines.local.launch).
        legs_now = [("shardline", lambda: launch_local(shardline_rank, payload,
                                                       WORLD_SIZE)[0]),
                    ("memmap", lambda: run_torchrun(Path(__file__).with_name("memmap_ddp.py"), mm_payload,
                                                    WORLD_SIZE)[0])]
        runs: dict[str, list[dict]] = {"shardline": [], "memmap": []}
        # ABBA rounds: other jobs' load drifts and hits both sides alike; the fastest round counts.
        for i in range(rounds):
            for name, leg in (legs_now if i % 2 == 0 else legs_now[::-1]):
                progress(f"round {i + 1}/{rounds}: {name}, {warmup} + {steps} steps")
                runs[name].append(leg())
        loads.append(load_average())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    legs = {k: min(v, key=lambda r: r["elapsed_s"]) for k, v in runs.items()}
    ours = legs["shardline"]
    rates = {k: global_batch * LENGTH * r["steps"] / r["elapsed_s"] for k, r in legs.items()}
    ratio = rates["shardline"] / rates["memmap"]
    per_cpu = {k: global_batch * LENGTH * r["steps"] / r["cpu_s"] for k, r in legs.items()}
    return {
        "benchmark": "train-tokens",
        "rows": rows,
        "sequence_length": LENGTH,
        "vocab": VOCAB,
        "model": {"name": "decoder", "d_model": D_MODEL, "layers": LAYERS, "heads": HEADS},
        "world_size": WORLD_SIZE,
        "threads_per_rank": threads,
        "cores": cores,
        "global_batch": global_batch,
        "steps": steps,
        "warmup_steps": warmup,
        "plan": json.loads(plan.model_dump_json()),
        "layout": {"train_shards": len(train.shards), "row_groups": sum(s.row_groups for s in train.shards),
                   "train_rows": train.rows},
        "prepare_s": significant(prepare_s),
        "seconds": {k: significant(r["elapsed_s"]) for k, r in legs.items()},
        "rounds": rounds,
        "tokens_per_s_by_round": {k: [significant(global_batch * LENGTH * r["steps"] / r["elapsed_s"]) for r in v]
                                  for k, v in runs.items()},
        "tokens_per_s": {k: significant(v) for k, v in rates.items()},
        "cpu_seconds": {k: significant(r["cpu_s"]) for k, r in legs.items()},
        "tokens_per_cpu_s": {k: significant(v) for k, v in per_cpu.items()},
        "data_wait": {k: significant(r["data_wait"]) for k, r in legs.items()},
        "ratio": {"vs_memmap": significant(ratio),
                  "per_cpu_vs_memmap": significant(per_cpu["shardline"] / per_cpu["memmap"])},
        "targets": {"vs_memmap": TARGET_VS_MEMMAP, "data_wait": TARGET_DATA_WAIT},
        "met": {"vs_memmap": ratio >= TARGET_VS_MEMMAP, "data_wait": ours["data_wait"] <= TARGET_DATA_WAIT},
        "load_average": loads,
    }


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else None), indent=1))
