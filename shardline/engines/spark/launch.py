"""A Spark barrier stage of N tasks, one rank each; rendezvous through BarrierTaskContext.

One code path for classic Spark and Spark Connect: the stage is
`spark.range(N, numPartitions=N).mapInArrow(rank_task, schema, barrier=True)`,
which both run (Connect has no RDD API and no sparkContext).
"""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from shardline.foundation.code_travel import UserCode, ship_to_spark
from shardline.foundation.environ import TaskPayload
from shardline.foundation.errors import ShardlineError
from shardline.foundation.spark_probe import failed_task, spark_error_line
from shardline.foundation.spark_setup import is_connect, master_as_written, spark_master, spark_setting

from shardline.training.launchers import DriverGuard, RankFn, TrainingFailed, announced, free_port, run_in_group
from shardline.training.launchers.rank_errors import RankError, lost_rank, rank_failures
from shardline.training.placement import Slot, host_of, slots

# Imported inside the functions that use them: pyspark (only with a Spark session: Dask and local jobs never
# import it).


@dataclass(frozen=True)
class TaskSlots:
    """How many tasks the Spark cluster runs at once, as far as its settings tell.

    count: exact for local masters; for cluster masters an upper bound from
    spark.cores.max or the executors' settings, None when nothing bounds it (then
    Spark's own barrier check decides, failing after
    spark.scheduler.barrier.maxConcurrentTasksCheck.* tries).
    """

    count: int | None
    where: str  # "Spark master local[2]", with the settings it came from


def spark_task_slots(spark) -> TaskSlots:
    master = spark_master(spark)
    cpus = int(spark_setting(spark, "spark.task.cpus") or 1)
    said = [f"spark.task.cpus={cpus}"] if cpus > 1 else []

    def slots(count: int | None, *settings: str) -> TaskSlots:
        notes = [*settings, *said]
        shown = master_as_written(spark)  # local[2] as configured, not the local[2,4] it runs as
        return TaskSlots(count, f"Spark master {shown}" + (f" ({', '.join(notes)})" if notes else ""))

    m = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\s*\d+)?\])?", master)
    if m:
        if m[1] == "*":
            cores = _local_cores(spark)
            return slots(cores // cpus, f"{cores} cores")
        return slots(int(m[1] or 1) // cpus)
    m = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]", master)
    if m:
        return slots(int(m[1]) * (int(m[2]) // cpus))
    cores_max = spark_setting(spark, "spark.cores.max")
    if cores_max:
        return slots(int(cores_max) // cpus, f"spark.cores.max={cores_max}")
    instances = spark_setting(spark, "spark.executor.instances")
    ecores = spark_setting(spark, "spark.executor.cores")
    if instances and ecores and not _dynamic_allocation(spark):
        return slots(
            int(instances) * (int(ecores) // cpus),
            f"spark.executor.instances={instances}", f"spark.executor.cores={ecores}",
        )
    return slots(None)


def _local_cores(spark) -> int:
    """Cores of local[*]: the partitions Spark gives a range by default (its default
    parallelism, the cores of the host the local executors run on: the Connect server's)."""
    rows = spark.sql(
        "SELECT count(DISTINCT p) AS n FROM (SELECT spark_partition_id() AS p FROM range(1048576))"
    ).collect()
    return int(rows[0]["n"])


def _dynamic_allocation(spark) -> bool:
    return (spark_setting(spark, "spark.dynamicAllocation.enabled") or "false").lower() == "true"


def check_spark_slots(spark, world_size: int, setting: str = "training.world_size") -> None:
    """Refuse what a barrier stage cannot get, before anything starts: a setting that
    rules barrier stages out, or fewer task slots than ranks."""
    master = spark_master(spark)
    if _dynamic_allocation(spark) and not master.startswith("local"):
        raise ShardlineError(
            "spark.dynamicAllocation.enabled is true: Spark refuses barrier stages (shardline's "
            "training ranks) under dynamic allocation [SPARK-24942]; set it to false for this job"
        )
    slots = spark_task_slots(spark)
    if slots.count is not None and world_size > slots.count:
        raise ShardlineError(
            f"{setting} {world_size} is greater than the {slots.count} task slots of "
            f"{slots.where}: a barrier stage needs them all at once"
        )


def launch_spark_barrier(
    spark, fn: RankFn, payload: Any, world_size: int, timeout_s: float = 300,
    guard: DriverGuard | None = None, code: UserCode | None = None,
) -> list[Any]:
    """Run `fn` on `world_size` ranks as one barrier stage; return the results by rank.

    code: the job's snapshot of the user's code (foundation.code_travel), shipped to the
    executors as a Python artifact and made current in each rank before `fn` runs.
    """
    check_spark_slots(spark, world_size)
    ship_to_spark(spark, code)
    # The rank function and its payload import torch when unpickled: opened inside the task,
    # after it has left a removed working folder (foundation.environ.TaskPayload).
    work = TaskPayload((fn, payload))

    def rank_task(batches):
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        rank_fn, job = work.open()

        for _ in batches:  # one row: this partition's index, which is the rank
            pass
        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        slot = spark_slot(rank, [info.address for info in ctx.getTaskInfos()], _use_task_gpu(ctx))
        host = host_of(ctx.getTaskInfos()[0].address)
        # Rank 0 picks the port on its own host, where the store will bind it.
        mine = f"{rank}:{free_port(host) if rank == 0 else 0}"
        port = next(int(m.split(":")[1]) for m in ctx.allGather(mine) if m.startswith("0:"))
        result = run_in_group(rank_fn, rank, world_size, f"tcp://{host}:{port}", job, timeout_s, guard,
                              slot=slot, code=code)
        yield pa.RecordBatch.from_pydict(
            {"rank": [rank], "result": [pickle.dumps(result)]},
            schema=pa.schema([("rank", pa.int32()), ("result", pa.binary())]),
        )

    ranks = spark.range(0, world_size, numPartitions=world_size)
    group = f"shardline-{uuid.uuid4().hex[:12]}"
    try:
        rows = collect_interruptibly(spark, ranks.mapInArrow(rank_task, "rank int, result binary", barrier=True),
                                     group, on_interrupt=guard.stop if guard is not None else None)
    except Exception as e:
        if "SPARK-24819" in str(e):  # Spark's own slot check, after its retries
            raise ShardlineError(
                f"training.world_size {world_size}: Spark could not give the barrier stage "
                f"{world_size} task slots at once ({spark_task_slots(spark).where} has fewer)"
            ) from None
        # The rank's own marker is inside Spark's text (a Python traceback in a Java one):
        # it names the rank, its host and its error; a killed rank's task has none.
        lost = "" if rank_failures(str(e)) else \
            _lost_task(e, getattr(payload, "ranks_dir", None), failed_executors(spark, group))
        raise TrainingFailed.from_ranks("Spark barrier stage", str(e), lost,
                                        ranks_dir=getattr(payload, "ranks_dir", None)) from e
    results = {r["rank"]: pickle.loads(r["result"]) for r in rows}
    return [results[r] for r in range(world_size)]


def collect_interruptibly(spark, frame, group: str, on_interrupt=None) -> list:
    """frame.collect() as job group `group`, which a Ctrl-C stops at once and in one line on
    classic Spark too; `on_interrupt` is called first (DriverGuard.stop: the ranks end
    before they commit another checkpoint, however long their tasks take to be interrupted).

    Classic PySpark pins one Py4J connection per thread, and its SIGINT handler cancels the
    jobs through it: while the main thread waits in collect() on that very connection, the
    handler's call re-enters it ("RuntimeError: reentrant call"), nothing is cancelled, and
    the ranks train on until their guard sees the driver gone. So the job runs in a thread
    of its own, under a job group whose cancellation interrupts its tasks (Spark then ends
    their Python workers), and the main thread, idle, cancels it. Connect's client cancels
    its own operations cleanly on KeyboardInterrupt.
    """
    if is_connect(spark):
        try:
            return frame.collect()
        except KeyboardInterrupt:
            if on_interrupt is not None:
                on_interrupt()
            raise

    from pyspark import InheritableThread  # the caller's local properties (a pool, a description) carry over

    sc = spark.sparkContext  # classic only: Connect returned above
    done, box = threading.Event(), {}

    def run() -> None:
        try:
            sc.setJobGroup(group, "shardline training ranks", interruptOnCancel=True)
            box["rows"] = frame.collect()
        except BaseException as e:  # handed to the main thread, which decides what is said
            box["error"] = e
        finally:
            done.set()

    InheritableThread(run, name="shardline-spark-job", daemon=True).start()
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        sc.cancelJobGroup(group)
        # The job fails at once, its tasks end a moment later (Spark ends a Python worker
        # still running 2 s after the interrupt): wait for that, so no rank trains or prints
        # after the driver said "aborted". The cancelled job's error is not the user's news.
        _wait_for_tasks_to_end(sc, group, within_s=30)
        raise KeyboardInterrupt from None
    if "error" in box:
        raise box["error"]
    return box["rows"]


def _wait_for_tasks_to_end(sc, group: str, within_s: float) -> None:
    tracker = sc.statusTracker()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        active = 0
        for job in tracker.getJobIdsForGroup(group):
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info else ():
                stage_info = tracker.getStageInfo(stage)
                active += stage_info.numActiveTasks if stage_info else 0
        if not active:
            return
        time.sleep(0.2)


def failed_executors(spark, group: str, within_s: float = 3.0) -> dict[int, str]:
    """{task index: executor id} of the failed tasks of job group `group`, from Spark's status
    store (classic Spark; Connect has no such API: {}). Spark's error for a barrier stage
    whose Python worker died names neither; the store hears of the failed task a moment
    after the job fails, so it is asked again for up to `within_s`."""
    if is_connect(spark):
        return {}
    deadline = time.monotonic() + within_s
    while True:
        try:
            found = _failed_tasks(spark.sparkContext, group)  # classic only: Connect returned above
        except Exception:  # a private API of Spark's: without it, the line names no executor
            return {}
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def _failed_tasks(sc, group: str) -> dict[int, str]:
    tracker, store = sc.statusTracker(), sc._jsc.sc().statusStore()
    found = {}
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in info.stageIds if info else ():
            stage_info = tracker.getStageInfo(stage)
            tasks = store.taskList(stage, stage_info.currentAttemptId if stage_info else 0, 10000)
            for i in range(tasks.size()):
                task = tasks.apply(i)
                if task.status() == "FAILED":
                    found[int(task.index())] = str(task.executorId())
    return found


def _lost_task(e: BaseException, ranks_dir: str | None = None, executors: dict[int, str] | None = None) -> str:
    """A rank whose process or executor died said nothing: name it from Spark's own report
    (its task index in the barrier stage is its rank; the executor, and its host when Spark
    says it), from the status store's record of its task (`executors`: the executor a
    crashed Python worker ran in) and from what the rank announced when it started
    (ranks/rank-N.json: its host and pid, training.loop.runner)."""
    task = failed_task(e)
    if not task:
        return spark_error_line(e)
    rank, _, where = task  # "host (executor id)", "executor id" or "unknown host"
    named = re.search(r"executor ([^)\s]+)", where)
    executor = named[1] if named else (executors or {}).get(rank)
    spark_host = where.split(" (executor")[0] if " (executor" in where else None
    said = announced(ranks_dir, rank) or {}
    host = said.get("host") or spark_host
    detail = [spark_host] if spark_host and spark_host != host else []
    detail += [f"executor {executor}"] if executor else []
    if host is None:  # no host known: the executor is where it ran
        host, detail = (f"executor {executor}", []) if executor else ("unknown host", [])
    return lost_rank(rank, host, spark_error_line(e), said.get("pid"), ", ".join(detail))


def spark_slot(rank: int, addresses: list[str], task_gpu: str | None) -> Slot:
    """The rank's slot: its host's ranks from the barrier stage's task addresses (in
    partition order, which is rank order), and the GPU Spark gave its task, which wins."""
    hosts = [host_of(a) for a in addresses]
    gpus: list[int | None] = [None] * len(hosts)
    if task_gpu is not None:
        if not task_gpu.isdigit():  # a discovery script's own naming: not a CUDA index
            raise RankError.of(rank, ShardlineError(
                f"Spark gave rank {rank}'s task GPU address {task_gpu!r}, not a CUDA device index: "
                "the GPU discovery script (spark.executor.resource.gpu.discoveryScript) must list indices"
            ))
        gpus[rank] = int(task_gpu)
    return slots(hosts, gpus, "Spark's task resources (spark.task.resource.gpu.amount)")[rank]


def _use_task_gpu(ctx) -> str | None:
    """With GPU scheduling (spark.task.resource.gpu.amount), the GPU Spark gave this task.

    An index, not CUDA_VISIBLE_DEVICES: Spark reuses Python workers, and CUDA may
    already be initialised in this one. It is also exported as SHARDLINE_CUDA_DEVICE,
    for code the rank runs; NCCL ranks then never share a GPU.
    """
    gpu = ctx.resources().get("gpu")
    if gpu is not None and gpu.addresses:
        os.environ["SHARDLINE_CUDA_DEVICE"] = gpu.addresses[0]
        return gpu.addresses[0]
    os.environ.pop("SHARDLINE_CUDA_DEVICE", None)
    return None
