"""Scoring on Spark: units dealt into a few tasks per slot, on classic Spark and Spark Connect alike."""

from __future__ import annotations

import pickle
import re

from shardline.foundation.environ import leave_removed_cwd
from shardline.foundation.errors import ShardlineError
from shardline.foundation.spark_probe import failed_task, spark_error_line

from shardline.serving.ledger import read_entry
from shardline.serving.worker import UnitTask, score_unit

from .launch import spark_task_slots

# Tasks per task slot. One task per unit was 0.72-0.74 x plain processes on 14 units over
# 2 slots, two tasks per slot 0.82-0.88, one 0.99-1.02 (8M rows, idle 2-core machine): each
# task costs far more than its 0.07-0.25 s of scheduling. The price: a slot that is slower
# (a busy executor) is not relieved by a faster one; units are balanced by rows up front.
TASKS_PER_SLOT = 1


def run_units(spark, tasks: list[UnitTask]) -> list[dict]:
    # DataFrame operations, no RDD: Connect has none. A range of n rows in n partitions holds
    # one index each: one group of units per task. Only ledger entries come back to the driver.
    groups = deal(tasks, _slots(spark))

    def score_partition(batches):
        import pyarrow as pa

        leave_removed_cwd()  # before the model's torch is imported (foundation.environ)

        for batch in batches:
            for g in batch.column("id").to_pylist():
                for i in groups[g]:
                    try:
                        # A retried task skips the units an earlier attempt of this job committed.
                        entry = _committed(tasks[i]) or score_unit(tasks[i])
                    except Exception as e:  # Spark reports only this text: name the unit in it
                        raise RuntimeError(f"<<unit {tasks[i].unit.path}>> {type(e).__name__}: {e}") from e
                    yield pa.RecordBatch.from_pydict({"entry": [pickle.dumps(entry)]})

    units = spark.range(0, len(groups), numPartitions=len(groups))
    try:
        rows = units.mapInArrow(score_partition, "entry binary").collect()
    except Exception as e:  # a task that failed every attempt; committed units stay committed
        line = spark_error_line(e)
        named = re.search(r"<<unit (.+?)>> (.*)", line)
        if named:  # the task's own error, after Spark's retries
            raise ShardlineError(f"Spark scoring job failed on unit {named[1]}: {named[2]}") from e
        task = failed_task(e)  # a worker that died says nothing: Spark's report names its task
        unit = ""
        if task:
            paths = ", ".join(tasks[i].unit.path for i in groups[task[0]])
            unit = f" on unit{'s' if len(groups[task[0]]) > 1 else ''} {paths} ({task[1]} attempt(s), last on {task[2]})"
        raise ShardlineError(f"Spark scoring job failed{unit}: {line}") from e
    return [pickle.loads(r["entry"]) for r in rows]


def deal(tasks: list[UnitTask], slots: int | None) -> list[list[int]]:
    """Task indices in groups, TASKS_PER_SLOT groups per slot, balanced by rows (largest unit
    first into the lightest group). Unbounded slots (a cluster whose size no setting says):
    one unit per task, as many tasks as Spark can run."""
    if not slots or len(tasks) <= slots * TASKS_PER_SLOT:
        return [[i] for i in range(len(tasks))]
    weight = [t.unit.rows or 1 for t in tasks]  # a unit of unknown size counts as one row
    groups: list[list[int]] = [[] for _ in range(slots * TASKS_PER_SLOT)]
    load = [0] * len(groups)
    for i in sorted(range(len(tasks)), key=lambda i: -weight[i]):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += weight[i]
    return groups


def _slots(spark) -> int | None:
    return spark_task_slots(spark).count


def _committed(task: UnitTask) -> dict | None:
    """The unit's ledger entry if this job (its `scored_at`) already committed it."""
    entry = read_entry(task.output_dir, task.unit.unit_id)
    if entry and entry.get("scored_at") == task.scored_at and entry.get("fingerprint") == task.unit.fingerprint:
        return entry
    return None
