"""What the sample cannot measure: each engine's own costs around the work, and the
memory a process holds before any row. Calibrated on the development machine (2 cores,
pyspark 4.3.0 local[N], Dask LocalCluster of N single-thread workers) by
`shardline bench scale`, which prints every figure beside the forecast's; on another
cluster the bench is how to check them (docs/guide/capacity.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCosts:
    task_s: float  # one task's fixed cost: scheduling, a worker's round trip, its result
    job_s: float  # pass 1's job: its fixed cost (a stage starting and ending)
    shuffle_job_s: float  # pass 2's job: a shuffle's fixed cost (two stages; Dask's P2P set-up)
    # The engine's shuffle per row as a multiple of the sample's Arrow IPC round trip of the
    # same rows (sample_engine): serialising into the engine, spilling, fetching.
    shuffle_x: float
    # In-process CPU over the engine's CPU for the same rows: the engine's own work around
    # the tasks (a JVM's Arrow conversions, a scheduler, nannies, the driver's side).
    efficiency: float
    rank_start_s: float  # ranks launched on a warm engine: the group formed, the model built, first batch
    score_start_s: float  # a scoring job's fixed cost: the model loaded in each worker, the ledger


# Calibrated 2026-11-29 by `shardline bench scale --rows 1000000` on the 2-core machine while
# it was busy (load average 35-45): the work from CPU seconds (the process tree's, against the
# sample's in-process CPU: Spark 9.4 s against 4.7 s for 1M rows, Dask 12.4 s), the fixed
# costs from the small legs' wall times, which that load stretches; an idle run re-checks them.
ENGINES = {
    "spark": EngineCosts(task_s=0.02, job_s=1.0, shuffle_job_s=2.0, shuffle_x=18.0, efficiency=0.8,
                         rank_start_s=2.5, score_start_s=3.0),
    "dask": EngineCosts(task_s=0.01, job_s=0.3, shuffle_job_s=2.5, shuffle_x=32.0, efficiency=0.8,
                        rank_start_s=0.5, score_start_s=2.0),
}

# Memory a process holds before it reads a row (MB): Python with pyarrow and pandas (a
# Spark Python worker, a Dask worker), and with torch too (a rank, a scoring task).
WORKER_BASE_MB = 180.0
TORCH_BASE_MB = 380.0
# The driver's memory per input file (its RawFile, Unit and manifest entry) and per shard:
# 100,000 CSV files added 54 MB (pipelines.raw.describe, measured 2026-11-29).
DRIVER_MB_PER_FILE = 0.00055
DRIVER_MB_PER_SHARD = 0.002
# gloo's all-reduce: ~0.8 GB/s between processes of one host (0.74-1.05 measured here); between
# hosts a 10 Gb/s network is assumed.
LOOPBACK_BYTES_PER_S = 0.8e9
NETWORK_BYTES_PER_S = 1.25e9
# A ddp step's CPU over the compute measured in one process (DDP's hooks, gloo's thread: 1.3x
# here), and an all-reduce's latency however small the gradients (gloo on loopback).
DDP_STEP_X = 1.3
ALLREDUCE_LATENCY_S = 2e-4
# DDP's buffers per weight: the weights, their gradients, DDP's gradient buckets and AdamW's
# two moments, 4 bytes each.
TRAIN_BYTES_PER_WEIGHT = 5 * 4


# What the forecast tells the user to set, per engine: (hosts, cores a host, MB a core) ->
# settings, memory rounded up to 256 MB.
SETTINGS = {
    "spark": lambda hosts, cores, mb: {
        "spark.executor.instances": str(hosts), "spark.executor.cores": str(cores),
        "spark.executor.memory": f"{256 * math.ceil(mb * cores / 256)}m", "spark.task.cpus": "1"},
    "dask": lambda hosts, cores, mb: {
        "dask workers": f"{hosts * cores} (one thread each)", "dask memory_limit": f"{256 * math.ceil(mb / 256)}m"},
}
