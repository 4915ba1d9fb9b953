"""Spark scoring retries by default in local mode (#17 item 5): shardline's own local
master is `local[2,4]`, so a Python worker SIGKILLed mid-unit is retried and the job ends
exactly once; a unit that fails every attempt is named, with the cause, in one line.
Its own JVM (a subprocess with the default SparkConfig), not the session's `local[2,1]`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import REPO
from .faults_models import AlwaysFails
from .scoring_faults import DiesBetweenOutputAndLedger
from .serving_helpers import raw_table, register_wrapped, version_dir, write_raw
from .test_serving_recovery import _assert_exactly_once, _died_between_output_and_ledger

JOBS = """
import sys
from pipelines.config import SparkConfig
from pipelines.engines import spark_session
from pipelines.errors import ShardlineError
from pipelines.spark_setup import spark_master
from serving.score import score
spark = spark_session(SparkConfig(shuffle_partitions=2))  # shardline's default master
print("MASTER", spark_master(spark))
r = score("spark", spark, sys.argv[1], sys.argv[3], sys.argv[4], sys.argv[5], batch_size=256)
print("ROWS", r.rows, r.files_scored)
try:
    score("spark", spark, sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[6], batch_size=256)
except ShardlineError as e:
    print("ERROR", e)
"""


@pytest.mark.slow
def test_default_local_master_retries_a_killed_worker_and_names_a_unit_that_keeps_failing(
    prepared, tracking_uri, tmp_path
):
    marker = tmp_path / "died"
    dies = register_wrapped(prepared, tracking_uri, "faults-dies-once",
                            lambda inner: DiesBetweenOutputAndLedger(inner, str(marker)))
    fails = register_wrapped(prepared, tracking_uri, "faults-always-fails", AlwaysFails)
    raw = raw_table(prepared)
    # Six units on two slots are dealt into two tasks of three (serving.engine_spark.deal):
    # the retried task holds units besides the one that died.
    write_raw(raw, tmp_path / "in", files=6)
    out, out_failed = tmp_path / "scores", tmp_path / "scores-failed"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(JOBS), dies, fails, tracking_uri, str(tmp_path / "in"),
         str(out), str(out_failed)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MASTER local[2,4]" in proc.stdout, proc.stdout
    # The worker really died mid-job, and the job still ended whole and exactly once.
    _died_between_output_and_ledger(marker, version_dir(out))
    assert f"ROWS {raw.num_rows} 6" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    _assert_exactly_once(out, raw.num_rows, 6)
    (error,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR ")]
    names = [p.name for p in Path(tmp_path / "in").iterdir()]
    assert error.startswith("ERROR Spark scoring job failed on unit "), error
    assert any(f"/in/{name}: " in error for name in names), error
    assert error.endswith(": RuntimeError: injected: this model always fails"), error
