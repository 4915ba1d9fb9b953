"""`shardline bench loader` at a tiny size: figures there and positive (no timing claims);
petastorm skipped (making its venv needs the network and minutes)."""

from __future__ import annotations

import json

import pytest


def test_bench_loader_tiny(tmp_path):
    from benchmarks.loader import BATCH_SIZE, NAIVE_BATCHES, run

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
    assert set(result["ratio"]) == {"vs_raw_pyarrow", "vs_naive"}
    figures = [*result["seconds"].values(), *result["samples_per_s"].values(),
               *result["ratio"].values(), result["cores"], result["feature_width"]]
    assert all(isinstance(v, (int, float)) and v > 0 for v in figures)
    assert result["targets"] == {"vs_raw_pyarrow": 0.85, "vs_petastorm": 3.0}
    assert isinstance(result["met"]["vs_raw_pyarrow"], bool)
    assert result["met"]["vs_petastorm"] is None
    assert result["petastorm"]["status"] == "skipped"
    assert set(result["ours_settings"]) == {"shuffle_buffer_rows", "workers", "prefetch"}


def test_petastorm_venv_failure_is_one_line(tmp_path, monkeypatch):
    """A venv that cannot be made: one line naming the step and the log, nothing left."""
    from benchmarks.loader import petastorm_venv

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
