"""Spark scoring retries by default in local mode (#17 item 5): shardline's own local
master is `local[2,4]`, so a task whose model raises once is retried and a Python worker
SIGKILLed mid-unit is retried, and each job ends exactly once; a unit that fails every
attempt is named, with the cause, in one line.

Its own JVM (a subprocess with the default SparkConfig's master), not the session's
`local[2,1]` (which tries each task once). One JVM runs all three jobs, one after another, each with
its own model and output: starting a JVM and its Python workers is most of each job's
cost, and a job's faults are confined to that job (its own marker file, its own model)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import REPO
from .faults_models import AlwaysFails
from .scoring_faults import DiesBetweenOutputAndLedger
from .serving_helpers import raw_table, register_flaky, register_wrapped, version_dir, write_raw
from .test_serving_recovery import _assert_exactly_once, _died_between_output_and_ledger

JOBS = """
import sys
from shardline.foundation.engine_config import SparkConfig
from shardline.foundation.sessions import spark_session
from shardline.foundation.errors import ShardlineError
from shardline.foundation.spark_setup import spark_master
from tests.serving_helpers import score  # a python -c program: no package to be relative to
flaky, dies, fails, tracking_uri, src, src_failed, out_flaky, out_dies, out_failed = sys.argv[1:]
# shardline's default master; Python workers forked with torch and MLflow already imported
# (each failed attempt is a fresh worker: tests/preloaded_spark_daemon.py).
spark = spark_session(SparkConfig(shuffle_partitions=2,
                                  conf={"spark.python.daemon.module": "tests.preloaded_spark_daemon"}))
print("MASTER", spark_master(spark), flush=True)
r = score("spark", spark, flaky, tracking_uri, src, out_flaky, batch_size=256, allow_pickled=True)
print("RETRIED", r.rows, r.files_scored, flush=True)
r = score("spark", spark, dies, tracking_uri, src, out_dies, batch_size=256, allow_pickled=True)
print("ROWS", r.rows, r.files_scored, flush=True)
try:
    score("spark", spark, fails, tracking_uri, src_failed, out_failed, batch_size=256, allow_pickled=True)
except ShardlineError as e:
    print("ERROR", e, flush=True)
"""


@pytest.fixture(scope="module")
def default_master_jobs(prepared, tracking_uri, tmp_path_factory):
    """The three jobs, run once in one JVM with shardline's default master: paths and the
    finished process (each test checks its returncode and its own job's lines)."""
    tmp = tmp_path_factory.mktemp("faults-spark")
    paths = {
        "in": tmp / "in", "in_failed": tmp / "in-failed", "flaky": tmp / "scores-flaky", "dies": tmp / "scores",
        "failed": tmp / "scores-failed", "failed_once": tmp / "failed-once", "died": tmp / "died",
    }
    flaky = register_flaky(prepared, tracking_uri, paths["failed_once"], "flaky-spark-retry")
    dies = register_wrapped(prepared, tracking_uri, "faults-dies-once",
                            lambda inner: DiesBetweenOutputAndLedger(inner, str(paths["died"])))
    fails = register_wrapped(prepared, tracking_uri, "faults-always-fails", AlwaysFails)
    raw = raw_table(prepared)
    # Six units on two slots are dealt into two tasks of three (shardline.engines.spark.score.deal):
    # a retried task holds units besides the one that failed or died.
    write_raw(raw, paths["in"], files=6)
    # The unit that fails every attempt: one file, so one task. Each failed attempt costs a
    # fresh Python worker (torch and MLflow imported again); a second task failing beside it
    # would only double that, and the message names the unit whichever task it was in.
    write_raw(raw.slice(0, 100), paths["in_failed"], files=1)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(JOBS), flaky, dies, fails, tracking_uri, str(paths["in"]),
         str(paths["in_failed"]), str(paths["flaky"]), str(paths["dies"]), str(paths["failed"])],
        cwd=tmp, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900,
    )
    return raw, paths, proc


def _ran(proc) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "MASTER local[2,4]" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_spark_task_retry_commits_each_unit_once(default_master_jobs):
    """A task whose model raises on its first call is retried by Spark (a cluster's
    spark.task.maxFailures, here local mode's): the job succeeds, each unit committed once."""
    raw, paths, proc = default_master_jobs
    _ran(proc)
    assert paths["failed_once"].exists()  # the fault did happen
    assert f"RETRIED {raw.num_rows} 6" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    _assert_exactly_once(paths["flaky"], raw.num_rows, 6)


@pytest.mark.slow
def test_default_local_master_retries_a_killed_worker_and_names_a_unit_that_keeps_failing(default_master_jobs):
    raw, paths, proc = default_master_jobs
    _ran(proc)
    out = paths["dies"]
    # The worker really died mid-job, and the job still ended whole and exactly once.
    _died_between_output_and_ledger(paths["died"], version_dir(out))
    assert f"ROWS {raw.num_rows} 6" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    _assert_exactly_once(out, raw.num_rows, 6)
    (error,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR ")]
    assert error.startswith("ERROR Spark scoring job failed on unit "), error
    assert "/in-failed/part-0000.parquet: " in error, error
    assert error.endswith(": RuntimeError: injected: this model always fails"), error
