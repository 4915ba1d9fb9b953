"""How Spark scoring deals units into tasks, and how a retried task knows what its job committed.

The end-to-end proofs that a grouped task's retry still ends exactly once are the
Spark kill tests (test_faults_spark.py: a worker dies between a unit's output and
its ledger entry and its task is retried; test_serving_recovery.py)."""

from __future__ import annotations

from shardline.engines.spark.score import TASKS_PER_SLOT, _committed, deal
from shardline.serving.inputs import Transform, Unit
from shardline.serving.ledger import commit
from shardline.serving.worker import UnitTask


def _task(path: str, rows: int | None, out: str = "/nowhere", scored_at: str = "", fingerprint: str = "f") -> UnitTask:
    return UnitTask(
        unit=Unit(path, "shard", fingerprint, rows), output_dir=out, output_name="o", model_uri="models:/m/1",
        tracking_uri="", model_name="m", model_version="1", transform=Transform("{}", "{}", 1),
        batch_size=1, scored_at=scored_at,
    )


def test_few_units_or_an_unbounded_cluster_get_one_task_each():
    tasks = [_task(f"u{i}", 10) for i in range(2 * TASKS_PER_SLOT)]
    assert deal(tasks, 2) == [[i] for i in range(len(tasks))]
    many = [_task(f"u{i}", 10) for i in range(50)]
    assert deal(many, None) == [[i] for i in range(50)]


def test_many_units_are_dealt_balanced_by_rows_each_exactly_once():
    rows = [900, 100, 100, 100, 400, 400, 300, 300, 200, 200, 100]
    tasks = [_task(f"u{i}", r) for i, r in enumerate(rows)]
    groups = deal(tasks, 4 // TASKS_PER_SLOT)  # four tasks
    assert len(groups) == 4
    assert sorted(i for g in groups for i in g) == list(range(len(rows)))
    # Largest first into the lightest group: 3100 rows in four groups, the 900-row unit alone.
    assert [sum(rows[i] for i in g) for g in groups] == [900, 800, 700, 700]
    assert groups[0] == [0]


def test_a_retry_skips_only_units_this_job_committed(tmp_path):
    out, job = str(tmp_path), "2026-11-25T00:00:00.123456+00:00"
    done = _task("u-done", 5, out, job)
    entry = {"unit": "u-done", "unit_id": done.unit.unit_id, "fingerprint": "f", "output": "scores-o.parquet", "rows": 5,
             "model_name": "m", "model_version": "1", "model_uri": "models:/m/1", "scored_at": job}
    commit(out, entry)
    assert _committed(done) == entry
    assert _committed(_task("u-new", 5, out, job)) is None  # nothing committed for it
    # The same unit committed by an earlier job (another scored_at), or a changed file
    # (another fingerprint) scored again into the same name: not this job's commit.
    assert _committed(_task("u-done", 5, out, "2026-11-24T00:00:00+00:00")) is None
    assert _committed(_task("u-done", 5, out, job, fingerprint="changed")) is None
