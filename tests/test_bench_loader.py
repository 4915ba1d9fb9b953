"""`shardline bench loader` at a tiny size: every figure is there and keeps its relations
(no timing claims); petastorm skipped (making its venv needs the network and minutes)."""

from __future__ import annotations

import json
import os

import pytest

from .bench_figures import assert_met, assert_quotient


def test_bench_loader_tiny(tmp_path):
    from shardline.benchmarks.loader import BATCH_SIZE, NAIVE_BATCHES, run

    result = run(20_000, workdir=str(tmp_path), progress=lambda msg: None, petastorm=False)
    json.dumps(result)  # one JSON object
    assert result["benchmark"] == "loader"
    assert result["batch_size"] == BATCH_SIZE
    assert 0 < result["train_rows"] < 20_000
    methods = {"ours", "raw_pyarrow", "naive"}
    assert set(result["seconds"]) == set(result["samples_per_s"]) == set(result["samples"]) == methods
    # Every method drops only the short last batch: the same whole batches of the split
    # (naive: its first NAIVE_BATCHES batches, all of them at this size).
    whole = result["train_rows"] // BATCH_SIZE * BATCH_SIZE
    assert 0 < whole <= NAIVE_BATCHES * BATCH_SIZE
    assert all(n == whole for n in result["samples"].values())
    # Each rate is its samples over its own seconds; each ratio the quotient of the rates it names.
    secs, sps = result["seconds"], result["samples_per_s"]
    for m in methods:
        assert_quotient(sps[m], result["samples"][m], secs[m], f"samples_per_s[{m}]")
    assert set(result["ratio"]) == {"vs_raw_pyarrow", "vs_naive"}
    for k in ("raw_pyarrow", "naive"):
        assert_quotient(result["ratio"][f"vs_{k}"], sps["ours"], sps[k], f"ratio vs_{k}")
    assert result["cores"] == len(os.sched_getaffinity(0)) and result["feature_width"] > 0
    t = result["targets"]
    assert_met(result["met"]["vs_raw_pyarrow"], result["ratio"]["vs_raw_pyarrow"], t["vs_raw_pyarrow"], "raw")
    assert result["met"]["vs_petastorm"] is None  # not measured: no claim either way
    assert result["petastorm"]["status"] == "skipped"
    assert set(result["ours_settings"]) == {"shuffle_buffer_rows", "workers", "prefetch"}


def test_petastorm_venv_failure_is_one_line(tmp_path, monkeypatch):
    """A venv that cannot be made: one line naming the step and the log, nothing left."""
    from shardline.benchmarks.loader import petastorm_venv

    blocker = tmp_path / "venv"
    blocker.write_text("a file where the venv should go")
    monkeypatch.setenv("SHARDLINE_PETASTORM_VENV", str(blocker))
    with pytest.raises(RuntimeError) as e:
        petastorm_venv(progress=lambda msg: None)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("making petastorm's venv failed at `-m venv")
    assert (tmp_path / "venv.log").is_file() and str(tmp_path / "venv.log") in msg
    assert not (tmp_path / "venv" / ".shardline-ready").exists()
