"""A Spark barrier stage of N tasks, one rank each; rendezvous through BarrierTaskContext."""

from __future__ import annotations

import pickle
from typing import Any

from pipelines.errors import ShardlineError

from . import RankFn, TrainingFailed, free_port, run_in_group


def spark_task_slots(spark) -> int:
    return spark.sparkContext.defaultParallelism


def check_spark_slots(spark, world_size: int) -> None:
    slots = spark_task_slots(spark)
    if world_size > slots:
        raise ShardlineError(
            f"training.world_size {world_size} is greater than the {slots} task slots of "
            f"Spark master {spark.sparkContext.master}: a barrier stage needs them all at once"
        )


def launch_spark_barrier(
    spark, fn: RankFn, payload: Any, world_size: int, timeout_s: float = 300
) -> list[Any]:
    """Run `fn` on `world_size` ranks as one barrier stage; return the results by rank."""
    check_spark_slots(spark, world_size)

    def rank_task(_):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        _use_task_gpu(ctx)
        host = ctx.getTaskInfos()[0].address.rsplit(":", 1)[0]
        # Rank 0 picks the port on its own host, where the store will bind it.
        mine = f"{rank}:{free_port(host) if rank == 0 else 0}"
        port = next(int(m.split(":")[1]) for m in ctx.allGather(mine) if m.startswith("0:"))
        result = run_in_group(fn, rank, world_size, f"tcp://{host}:{port}", payload, timeout_s)
        yield pickle.dumps((rank, result))

    rdd = spark.sparkContext.parallelize(range(world_size), world_size)
    try:
        out = rdd.barrier().mapPartitions(rank_task).collect()
    except Exception as e:
        raise TrainingFailed(f"Spark barrier stage failed: {_root_cause(e)}") from e
    results = dict(pickle.loads(b) for b in out)
    return [results[r] for r in range(world_size)]


def _use_task_gpu(ctx) -> None:
    """With GPU scheduling (spark.task.resource.gpu.amount), use the GPU Spark gave this task.

    An index, not CUDA_VISIBLE_DEVICES: Spark reuses Python workers, and CUDA may
    already be initialised in this one. training.worker reads it; NCCL ranks then
    never share a GPU.
    """
    import os

    gpu = ctx.resources().get("gpu")
    if gpu is not None and gpu.addresses:
        os.environ["SHARDLINE_CUDA_DEVICE"] = gpu.addresses[0]
    else:
        os.environ.pop("SHARDLINE_CUDA_DEVICE", None)


def _root_cause(e: Exception) -> str:
    # A Python error inside a task arrives wrapped in Java's stack; keep its last line.
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln and not ln.startswith("at "):
            return ln[:300]
    return lines[0][:300] if lines else type(e).__name__
