"""Scoring on Spark: one task per input unit, on classic Spark and Spark Connect alike."""

from __future__ import annotations

import pickle

from pipelines.errors import ShardlineError
from pipelines.spark_probe import spark_error_line

from .worker import UnitTask, score_unit


def run_units(spark, tasks: list[UnitTask]) -> list[dict]:
    # One partition per unit (a range of n rows in n partitions holds one index each):
    # a failed task retries exactly one unit, which rewrites the same output name; only
    # ledger entries come back to the driver. DataFrame operations, no RDD: Connect has none.
    def score_partition(batches):
        import pyarrow as pa

        for batch in batches:
            for i in batch.column("id").to_pylist():
                entry = score_unit(tasks[i])
                yield pa.RecordBatch.from_pydict({"entry": [pickle.dumps(entry)]})

    units = spark.range(0, len(tasks), numPartitions=len(tasks))
    try:
        rows = units.mapInArrow(score_partition, "entry binary").collect()
    except Exception as e:  # a task that failed every attempt; committed units stay committed
        raise ShardlineError(f"Spark scoring job failed: {spark_error_line(e)}") from e
    return [pickle.loads(r["entry"]) for r in rows]
