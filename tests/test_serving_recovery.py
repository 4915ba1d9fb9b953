"""Exactly once under failure: task retries, a failed job re-run, a killed job re-run.

Faults are real: a registered model that fails its first call (a task really
fails and the engine really retries it), a scoring process killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from serving.ledger import LEDGER, read_ledger
from serving.score import score

from .conftest import REPO
from .serving_helpers import raw_table, read_scores, register_flaky, trained_model, write_raw


@pytest.fixture(scope="module")
def raw(prepared):
    return raw_table(prepared)


def _assert_exactly_once(out: Path, rows: int, units: int) -> None:
    keys = read_scores(out).column("key").to_numpy()
    assert len(keys) == len(set(keys)) == rows
    ledger = read_ledger(out)
    assert len(ledger) == units
    # No orphans and no temp files: every file in the directory is a committed unit.
    assert sorted(p.name for p in out.iterdir() if p.name not in ("_lock", LEDGER)) == sorted(
        e["output"] for e in ledger.values()
    )


def test_dask_task_retry_commits_each_unit_once(dask_client, prepared, raw, tracking_uri, tmp_path):
    uri = register_flaky(prepared, tracking_uri, tmp_path / "failed-once", "flaky-dask")
    write_raw(raw, tmp_path / "in", files=4)
    out = tmp_path / "scores"
    r = score("dask", dask_client, uri, tracking_uri, str(tmp_path / "in"), str(out), batch_size=256)
    assert (tmp_path / "failed-once").exists()  # the fault did happen
    assert (r.rows, r.files_scored) == (raw.num_rows, 4)
    _assert_exactly_once(out, raw.num_rows, 4)


def test_failed_spark_job_rerun_scores_only_missing_units(spark, prepared, raw, tracking_uri, tmp_path):
    # local[2] does not retry tasks: the injected fault fails the whole job.
    uri = register_flaky(prepared, tracking_uri, tmp_path / "failed-once", "flaky-spark")
    write_raw(raw, tmp_path / "in", files=6)
    out = tmp_path / "scores"
    with pytest.raises(Exception, match="injected failure"):
        score("spark", spark, uri, tracking_uri, str(tmp_path / "in"), str(out), batch_size=256)
    committed = len(read_ledger(out))
    assert committed < 6

    r = score("spark", spark, uri, tracking_uri, str(tmp_path / "in"), str(out), batch_size=256)
    assert (r.files_skipped, r.files_scored) == (committed, 6 - committed)
    _assert_exactly_once(out, raw.num_rows, 6)


def test_crash_between_output_and_ledger_rewrites_same_file(spark, prepared, raw, tracking_uri, tmp_path):
    model = trained_model(prepared)
    write_raw(raw, tmp_path / "in", files=3)
    out = tmp_path / "scores"
    score("spark", spark, model.model_uri, tracking_uri, str(tmp_path / "in"), str(out))
    # The state a crash leaves after os.replace of the output, before its ledger entry.
    lost = next(iter(read_ledger(out).values()))
    (out / LEDGER / f"{lost['unit_id']}.json").unlink()
    (out / f".{lost['output']}.deadbeef.tmp").write_bytes(b"half a file")

    r = score("spark", spark, model.model_uri, tracking_uri, str(tmp_path / "in"), str(out))
    assert (r.files_skipped, r.files_scored, r.rows) == (2, 1, lost["rows"])
    assert read_ledger(out)[lost["unit_id"]]["output"] == lost["output"]
    _assert_exactly_once(out, raw.num_rows, 3)


KILLED_JOB = """
from pipelines.config import DaskConfig
from pipelines.engines import dask_client
from serving.score import score
import sys
client = dask_client(DaskConfig(n_workers=2))
score("dask", client, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], batch_size=64)
"""


def test_killed_job_rerun_scores_the_rest(spark, prepared, raw, tracking_uri, tmp_path):
    model = trained_model(prepared)
    units = 120
    write_raw(raw, tmp_path / "in", files=units)
    out = tmp_path / "scores"
    # Dask in its own process group: SIGKILL takes the client, nannies and workers.
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_JOB), model.model_uri, tracking_uri,
         str(tmp_path / "in"), str(out)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None and not read_ledger(out):
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    committed = len(read_ledger(out))
    assert 0 < committed < units, proc.stderr.read().decode()[-2000:]

    # Re-run on the other engine: the ledger, not the engine, decides what is done.
    r = score("spark", spark, model.model_uri, tracking_uri, str(tmp_path / "in"), str(out))
    assert r.files_skipped >= committed and r.files_skipped + r.files_scored == units
    _assert_exactly_once(out, raw.num_rows, units)


SPARK_RETRY_JOB = """
import sys
from pipelines.config import SparkConfig
from pipelines.engines import spark_session
from serving.score import score
# local[2,2]: two attempts per task, as a cluster's spark.task.maxFailures would allow.
spark = spark_session(SparkConfig(master="local[2,2]", shuffle_partitions=2))
r = score("spark", spark, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], batch_size=256)
print("ROWS", r.rows, r.files_scored)
"""


def test_spark_task_retry_commits_each_unit_once(prepared, raw, tracking_uri, tmp_path):
    uri = register_flaky(prepared, tracking_uri, tmp_path / "failed-once", "flaky-spark-retry")
    write_raw(raw, tmp_path / "in", files=4)
    out = tmp_path / "scores"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SPARK_RETRY_JOB), uri, tracking_uri,
         str(tmp_path / "in"), str(out)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "failed-once").exists()
    assert f"ROWS {raw.num_rows} 4" in proc.stdout
    _assert_exactly_once(out, raw.num_rows, 4)
