"""Scores into a Delta table (`serving.output_format = "delta"`), exactly once (#47 item 3).

Read back by delta-rs itself, the table holds each input row once: after a run, after a
second run that finds nothing new, after more input arrives (an incremental run), after a
Dask worker is SIGKILLed mid-unit, after a run killed between its units' commits and the
table's commit, and on the S3 test server. Each append is one Delta transaction carrying
the run's idempotent transaction id (app id + version).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from shardline.foundation.errors import ConfigError
from shardline.foundation import storage
from shardline.serving.delta_output import SCORES, app_id
from shardline.serving.ledger import read_ledger, version_dir
from shardline.serving.score import plan

from .scoring_faults import StallsOnce
from .serving_helpers import raw_table, register_wrapped, score, trained_model, write_raw


@pytest.fixture(scope="module")
def raw(prepared):
    return raw_table(prepared)


def _table(root: str, **opts) -> pa.Table:
    return pa.table(DeltaTable(root, **opts).to_pyarrow_table())


def _appends(root: str) -> list[dict]:
    """The table's commits that appended rows, oldest first (their commitInfo)."""
    return [h for h in reversed(DeltaTable(root).history()) if h.get("operation") not in ("CREATE TABLE",)
            and h.get("operationMetrics", {}).get("num_added_files", 1)]


def _assert_once(root: str, keys) -> None:
    got = _table(root).column("key").to_pylist()
    assert len(got) == len(set(got)), "a key is in the table twice"
    assert sorted(got) == sorted(keys)


def test_two_runs_append_each_row_once(dask_client, prepared, raw, tracking_uri, tmp_path):
    model = trained_model(prepared)
    write_raw(raw, tmp_path / "in", files=3)
    out = str(tmp_path / "table")
    first = score("dask", dask_client, model.model_uri, tracking_uri, str(tmp_path / "in"), out,
                  batch_size=256, output_format="delta")
    assert (first.rows, first.files_scored, first.output_dir) == (raw.num_rows, 3, out)
    _assert_once(out, raw.column("key").to_pylist())
    table = DeltaTable(out)
    name, version = model.model_uri.split("/")[1:]
    assert table.transaction_version(app_id(name, version)) == 1  # one append, with its id
    commits = table.version()
    # Nothing new: no unit scored, no commit made, the rows still there once.
    second = score("dask", dask_client, model.model_uri, tracking_uri, str(tmp_path / "in"), out,
                   batch_size=256, output_format="delta")
    assert (second.rows, second.files_scored, second.files_skipped) == (0, 0, 3)
    assert DeltaTable(out).version() == commits
    _assert_once(out, raw.column("key").to_pylist())
    # More input: an incremental run appends the new file's rows only, in one more commit.
    more = raw.slice(0, 50).set_column(0, "key", pa.array(range(10**9, 10**9 + 50), pa.int64()))
    write_raw(more, tmp_path / "in", files=1, start=7)
    third = score("dask", dask_client, model.model_uri, tracking_uri, str(tmp_path / "in"), out,
                  batch_size=256, incremental=True, output_format="delta")
    assert (third.rows, third.files_scored) == (50, 1)
    assert DeltaTable(out).version() == commits + 1
    assert DeltaTable(out).transaction_version(app_id(name, version)) == 2
    _assert_once(out, raw.column("key").to_pylist() + more.column("key").to_pylist())
    # The scores sit in the table's hidden folder, beside their ledger; Delta lists only them.
    files = {f.rsplit("/", 1)[-1] for f in DeltaTable(out).file_uris()}
    assert files == {e["output"] for e in read_ledger(version_dir(storage.join(out, SCORES), name, version)).values()}
    assert all(f"/{SCORES}/" in f for f in DeltaTable(out).file_uris())


def test_units_committed_but_not_appended_are_appended_by_the_next_run(dask_client, prepared, raw, tracking_uri,
                                                                       tmp_path):
    """A run killed after its units' ledger entries and before the table's commit: the
    ledger holds the scores, the table does not; the next run, with nothing to score,
    appends them once."""
    model = trained_model(prepared)
    write_raw(raw, tmp_path / "in", files=2)
    out = str(tmp_path / "table")
    # The Parquet run writes exactly what a delta run writes into the hidden folder.
    score("dask", dask_client, model.model_uri, tracking_uri, str(tmp_path / "in"), f"{out}/{SCORES}",
          batch_size=256)
    assert not (Path(out) / "_delta_log").exists()
    p = plan(model.model_uri, tracking_uri, str(tmp_path / "in"), out, output_format="delta")
    assert not p.todo and len(p.skipped) == 2
    assert p.publish() == raw.num_rows
    _assert_once(out, raw.column("key").to_pylist())
    assert p.publish() == 0  # again: the table lists them all, nothing is appended twice
    _assert_once(out, raw.column("key").to_pylist())


def test_a_worker_killed_mid_unit_leaves_each_row_once(dask_client, prepared, raw, tracking_uri, tmp_path):
    marker = tmp_path / "stalled"
    uri = register_wrapped(prepared, tracking_uri, "stalls-delta", lambda inner: StallsOnce(inner, str(marker)))
    units = 6
    write_raw(raw, tmp_path / "in", files=units)
    out = str(tmp_path / "table")
    name, version = uri.split("/")[1:]
    ledger_dir = version_dir(storage.join(out, SCORES), name, version)
    workers = dask_client.run(os.getpid)
    seen: dict = {}
    stop = threading.Event()

    def kill_the_stalled_worker() -> None:
        while not stop.is_set():
            announced = Path(f"{marker}.json")
            if announced.exists() and read_ledger(ledger_dir):
                seen["pid"] = json.loads(announced.read_text())["pid"]
                seen["committed"] = len(read_ledger(ledger_dir))
                os.kill(seen["pid"], signal.SIGKILL)
                return
            stop.wait(0.01)

    killer = threading.Thread(target=kill_the_stalled_worker, daemon=True)
    killer.start()
    try:
        r = score("dask", dask_client, uri, tracking_uri, str(tmp_path / "in"), out, batch_size=64,
                  output_format="delta", allow_pickled=True)  # the wrapper is a pickled model
    finally:
        stop.set()
        killer.join()
        dask_client.wait_for_workers(len(workers), timeout=300)
    assert seen.get("pid") in workers.values(), "no worker was killed"
    assert 0 < seen["committed"] < units
    assert (r.rows, r.files_scored) == (raw.num_rows, units)
    _assert_once(out, raw.column("key").to_pylist())
    assert DeltaTable(out).transaction_version(app_id(name, version)) == 1  # still one append


def test_delta_output_on_s3(dask_client, prepared, raw, tracking_uri, tmp_path, bucket):
    from shardline.pipelines.delta_source import storage_options

    model = trained_model(prepared)
    write_raw(raw, tmp_path / "in", files=2)
    out = f"{bucket}/scores-table"
    for _ in range(2):
        score("dask", dask_client, model.model_uri, tracking_uri, str(tmp_path / "in"), out, batch_size=256,
              output_format="delta")
    got = _table(out, storage_options=storage_options(out)).column("key").to_pylist()
    assert sorted(got) == sorted(raw.column("key").to_pylist())


def test_an_output_that_is_not_a_delta_table_is_refused(prepared, tracking_uri, tmp_path):
    model = trained_model(prepared)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not a Delta table"):
        plan(model.model_uri, tracking_uri, prepared.dataset_dir, str(tmp_path / "out"), output_format="delta")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_the_cli_scores_the_test_split_into_a_delta_table_twice(dask_client, prepared, tracking_uri, tmp_path):
    """`shardline score` with serving.output_format = "delta", twice: each test row once,
    the second run scores nothing and commits nothing; `--status` reads the table's ledger."""
    from shardline.pipelines.manifest import load_manifest

    from .conftest import shardline_here

    model = trained_model(prepared)
    out = tmp_path / "table"
    args = ["score", "--model", model.model_uri, "--input", prepared.dataset_dir, "--output", str(out),
            "--engine", "dask", "--set", f"dask.address='{dask_client.scheduler.address}'",
            "--set", "serving.output_format='delta'", "--set", f"pipelines.dataset_dir='{prepared.dataset_dir}'"]
    env = {"MLFLOW_TRACKING_URI": tracking_uri}
    first = shardline_here(*args, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    test_rows = load_manifest(prepared.dataset_dir).splits["test"].rows
    keys = _table(str(out)).column("key").to_pylist()
    assert len(keys) == len(set(keys)) == test_rows
    again = shardline_here(*args, cwd=tmp_path, env=env)
    assert again.returncode == 0 and "nothing to score" in again.stdout + again.stderr, again.stderr
    assert sorted(_table(str(out)).column("key").to_pylist()) == sorted(keys)
    assert DeltaTable(str(out)).version() == 0  # created by the first run's one commit, nothing since
    status = shardline_here("score", "--status", str(out), cwd=tmp_path, env=env)
    assert status.returncode == 0 and f"{test_rows:,}" in status.stdout, status.stdout
