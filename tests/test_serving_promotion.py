"""Scoring across model promotion, through the real CLI: per-version outputs, --backfill,
--status, the fast paths (nothing to score, a held lease, a stale lease) and bad input.

The CLI runs in the test's process (`shardline_here`) on the session's Dask cluster
(`dask.address`): each scoring run in a fresh Python with its own LocalCluster cost several
seconds of imports and worker starts. The process's own exit codes are test_defaults'.
"No engine started" is read from the CLI's report: it prints a line when Spark or Dask
starts. A job SIGKILLed while holding the lease is a real process (`_dead_jobs_lease`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardline.foundation.lease import Holder
from shardline.serving.ledger import output_lease, read_ledger

from .conftest import absolute_paths, shardline_here
from .serving_helpers import promo_model, raw_table, write_raw

ENGINE_STARTED = ("Starting Dask", "Starting Spark")
DASK = ("--engine", "dask", "--set", "dask.n_workers=1")  # refused before Dask would start


@pytest.fixture(scope="module")
def session_dask(on_session_dask) -> tuple[str, ...]:
    """The engine arguments of a run that scores: the session's Dask scheduler."""
    return ("--engine", "dask", *on_session_dask)


@pytest.fixture(scope="module")
def raw(prepared):
    return raw_table(prepared)


@pytest.fixture(scope="module")
def promo(prepared, tracking_uri):
    return promo_model(prepared, tracking_uri)


def _alias(tracking_uri: str, version: int) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).set_registered_model_alias("promo", "champion", str(version))


def _cli(tracking_uri: str, cwd: Path, *args: str):
    # COLUMNS: rich lays --status's table out for a wide terminal, not the default 80.
    return shardline_here("score", *args, cwd=cwd, env={"MLFLOW_TRACKING_URI": tracking_uri, "COLUMNS": "250"})


def _score(tracking_uri, tmp_path, src, out, engine, *extra):
    # Absolute paths: a scheduler's workers may be on other hosts (the CLI refuses relative ones).
    return _cli(tracking_uri, tmp_path, "--model", "models:/promo@champion", "--input", str(src),
                "--output", str(out), "--incremental", *absolute_paths(tmp_path), *engine, *extra)


def _snapshot(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}


def test_promotion_scores_each_version_into_its_own_place_and_takes_over_a_dead_jobs_lease(
    promo, raw, tracking_uri, session_dask, tmp_path
):
    """Per-version outputs, --status, --backfill all and nothing-to-score, through the CLI.

    The --backfill run also finds the lease of a job SIGKILLed before it (no release): it
    takes the lease over and scores. That run is the stale-lease case's own CLI run, not a
    separate one: each scoring run loads the model on the workers again.
    """
    src, out = tmp_path / "incoming", tmp_path / "scores"
    write_raw(raw.slice(0, 200), src, files=2)
    _alias(tracking_uri, 1)
    r = _score(tracking_uri, tmp_path, src, out, session_dask)
    assert r.returncode == 0, r.stderr
    v1 = out / "model=promo" / "version=1"
    assert len(read_ledger(v1)) == 2
    v1_files = _snapshot(v1)

    # New data arrives, and the alias moves to version 2: no --force, version 1 untouched.
    write_raw(raw.slice(200, 100), src, files=1, start=2)
    _alias(tracking_uri, 2)
    r = _score(tracking_uri, tmp_path, src, out, session_dask)
    assert r.returncode == 0, r.stderr
    assert "100 rows from 1 file(s)" in r.stderr and "2 scored by other versions only" in r.stderr
    v2 = out / "model=promo" / "version=2"
    assert [e["unit"].rsplit("/", 1)[-1] for e in read_ledger(v2).values()] == ["part-0002.parquet"]
    assert _snapshot(v1) == v1_files

    # --status: per version, units and rows, and what each has not scored.
    r = _cli(tracking_uri, tmp_path, "--status", str(out), "--input", str(src))
    assert r.returncode == 0, r.stderr
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in r.stdout.splitlines() if "│ promo" in line]
    # model, version, units, rows, last scored, pending (of the input), interrupted
    assert [row[:4] + row[5:] for row in rows] == [
        ["promo", "1", "2", "200", "1", "0"],  # version 1 lacks the new file
        ["promo", "2", "1", "100", "2", "0"],  # version 2 lacks the two old ones
    ], r.stdout
    assert "0 file(s) of" in r.stdout and "no job is writing it now" in r.stdout

    # A job took the lease, then was SIGKILLed (no release): the next job takes it over.
    before = _dead_jobs_lease(out)
    # --backfill all: version 2 also scores what only version 1 had.
    r = _score(tracking_uri, tmp_path, src, out, session_dask, "--backfill", "all")
    assert r.returncode == 0, r.stderr
    assert f"took over the lease of {out}/_lease.json from shardline score (host" in r.stderr
    assert f"pid {before.pid}" in r.stderr and "is gone" in r.stderr
    assert not (out / "_lease.json").exists()  # and released it
    assert "200 rows from 2 file(s)" in r.stderr
    assert len(read_ledger(v2)) == 3 and _snapshot(v1) == v1_files
    whole = pq.read_table(out)  # Hive partitions: model and version columns
    assert sorted(zip(whole.column("version").to_pylist(), whole.column("model_version").to_pylist())) == sorted(
        [(1, "1")] * 200 + [(2, "2")] * 300
    )

    # Nothing left: exit 0 at once, no engine started.
    r = _score(tracking_uri, tmp_path, src, out, session_dask)
    assert r.returncode == 0, r.stderr
    assert "nothing to score: 3 file(s) already scored by promo version 2" in r.stderr
    assert not any(s in r.stderr for s in ENGINE_STARTED), r.stderr


def test_held_lease_refused_before_any_engine_with_exit_75(promo, raw, tracking_uri, tmp_path):
    src, out = tmp_path / "incoming", tmp_path / "scores"
    write_raw(raw.slice(0, 100), src, files=1)
    _alias(tracking_uri, 1)
    out.mkdir()
    with output_lease(out):  # a job holding the output, as another process would
        holder = _holder(out)
        r = _score(tracking_uri, tmp_path, src, out, DASK)
    assert r.returncode == 75, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert (f"is in use by shardline score (host {socket.gethostname()}, pid {os.getpid()}, "
            f"since {holder.since})") in line
    assert not any(s in r.stderr for s in ENGINE_STARTED)
    assert list(out.iterdir()) == []  # released by us; the refused job wrote nothing


def _holder(out: Path) -> Holder:
    return Holder.parse((out / "_lease.json").read_bytes())


def _dead_jobs_lease(out: Path) -> Holder:
    """Leave `out` with the lease of a job that took it and was then SIGKILLed: a real
    process, now gone. Its holder record."""
    code = ("import os, signal, sys; from shardline.serving.ledger import output_lease; "
            "output_lease(sys.argv[1]).acquire(); print(os.getpid(), flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    dead = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert dead.returncode == -9, dead.stderr
    holder = _holder(out)
    assert holder.pid == int(dead.stdout)
    return holder


def test_bad_input_one_line_nonzero_nothing_written(promo, raw, tracking_uri, session_dask, tmp_path):
    src = tmp_path / "incoming"
    write_raw(raw.slice(0, 100), src, files=1)

    def check(args, code, message, out, *more):
        """One CLI run: `code`, one line, `message` and each of `more` in it, no engine."""
        r = shardline_here("score", *args, "--input", str(src), "--output", str(out), *DASK, cwd=tmp_path,
                           env={"MLFLOW_TRACKING_URI": tracking_uri})
        assert r.returncode == code, r.stderr
        err = r.stderr.strip()
        assert "\n" not in err and err.startswith("error: ") and message in err, err
        assert all(m in err for m in more), err
        assert not any(s in r.stderr for s in ENGINE_STARTED)

    # An alias that points nowhere: the model's aliases are listed.
    _alias(tracking_uri, 1)
    out = tmp_path / "scores-a"
    check(["--model", "models:/promo@no-such-alias"], 1,
          "model models:/promo@no-such-alias: alias 'no-such-alias' of 'promo' points to no version "
          "in MLflow at", out, "(its aliases: @champion → version 1)")
    assert not out.exists()

    # A version whose input schema the input no longer has: every such column named.
    out = tmp_path / "scores-b"
    pq.write_table(raw.slice(0, 10).drop_columns(["x3", "color"]), src / "part-0000.parquet")
    check(["--model", "models:/promo/2"], 1,
          "part-0000.parquet: missing feature columns 'x3', 'color' that model promo version 2 takes", out)
    assert not out.exists()
    write_raw(raw.slice(0, 100), src, files=1)

    # An output holding another model's scores: refused, then --force says what it discards.
    out = tmp_path / "scores-c"
    other = out / "model=someone-else" / "version=7"
    (other / "_ledger").mkdir(parents=True)
    pq.write_table(raw.slice(0, 5).select(["key"]), other / "scores-0123456789abcdef.parquet")
    (other / "_ledger" / "0123456789abcdef.json").write_text(json.dumps({
        "unit": "/elsewhere/x.parquet", "unit_id": "0123456789abcdef", "fingerprint": "f",
        "output": "scores-0123456789abcdef.parquet", "rows": 5, "model_name": "someone-else",
        "model_version": "7", "model_uri": "models:/someone-else/7", "scored_at": "2026-01-01T00:00:00+00:00",
    }))
    before = _snapshot(out)
    check(["--model", "models:/promo/1"], 1,
          "holds scores of model someone-else (version 7), not of promo; choose another output "
          "directory or pass --force to discard them", out)
    assert _snapshot(out) == before

    r = _cli(tracking_uri, tmp_path, "--model", "models:/promo/1", "--input", str(src), "--output", str(out),
             "--force", *absolute_paths(tmp_path), *session_dask)
    assert r.returncode == 0, r.stderr
    assert (f"--force discards the scores of model someone-else version 7: 1 unit(s), 5 rows in {other}"
            in r.stderr)
    assert not list(other.rglob("*.parquet")) and len(read_ledger(out / "model=promo" / "version=1")) == 1
