"""Scoring on Spark: one task per input unit, on classic Spark and Spark Connect alike."""

from __future__ import annotations

import pickle
import re

from pipelines.errors import ShardlineError
from pipelines.spark_probe import failed_task, spark_error_line

from .worker import UnitTask, score_unit


def run_units(spark, tasks: list[UnitTask]) -> list[dict]:
    # One partition per unit (a range of n rows in n partitions holds one index each):
    # a failed task retries exactly one unit, which rewrites the same output name; only
    # ledger entries come back to the driver. DataFrame operations, no RDD: Connect has none.
    def score_partition(batches):
        import pyarrow as pa

        for batch in batches:
            for i in batch.column("id").to_pylist():
                try:
                    entry = score_unit(tasks[i])
                except Exception as e:  # Spark reports only this text: name the unit in it
                    raise RuntimeError(f"<<unit {tasks[i].unit.path}>> {type(e).__name__}: {e}") from e
                yield pa.RecordBatch.from_pydict({"entry": [pickle.dumps(entry)]})

    units = spark.range(0, len(tasks), numPartitions=len(tasks))
    try:
        rows = units.mapInArrow(score_partition, "entry binary").collect()
    except Exception as e:  # a task that failed every attempt; committed units stay committed
        line = spark_error_line(e)
        named = re.search(r"<<unit (.+?)>> (.*)", line)
        if named:  # the task's own error, after Spark's retries
            raise ShardlineError(f"Spark scoring job failed on unit {named[1]}: {named[2]}") from e
        task = failed_task(e)  # a worker that died says nothing: Spark's report names its task
        unit = f" on unit {tasks[task[0]].unit.path} ({task[1]} attempt(s), last on {task[2]})" if task else ""
        raise ShardlineError(f"Spark scoring job failed{unit}: {line}") from e
    return [pickle.loads(r["entry"]) for r in rows]
