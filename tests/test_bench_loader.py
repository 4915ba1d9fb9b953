"""`shardline bench loader` at a tiny size: every figure is there and keeps its relations
(no timing claims); petastorm skipped (making its venv needs the network and minutes)."""

from __future__ import annotations

import json
import os

import pytest

from .bench_figures import assert_met, assert_quotient


@pytest.mark.slow
def test_bench_loader_tiny(tmp_path):
    """Full tier only (`make test-all`, marker `slow`): a benchmark run: the loader against its raw
    baselines, each timed."""
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


@pytest.mark.slow
def test_bench_loader_images_tiny(tmp_path):
    """`shardline bench loader --images --json` on 24 images: one JSON object whose figures keep
    their relations (each rate its images over its own seconds, each ratio the quotient of the
    rates it names); nothing is claimed about speed.

    Full tier only (`make test-all`, marker `slow`): a benchmark run: the images loader against its
    baselines, each timed.
    """
    from shardline.benchmarks.loader_images import TARGET_VS_PILLOW

    from .conftest import shardline_here

    proc = shardline_here("bench", "loader", "--images", "--rows", "24", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["benchmark"] == "loader-images"
    assert result["images"] == result["train_images"] == 24  # every image in train
    assert result["formats"]["PNG"] > 0 and result["formats"]["JPEG"] > 0
    assert sum(result["formats"].values()) == 24
    many = result["loader_threads"][1]
    assert result["loader_threads"] == [1, many] and many >= 2
    methods = {"pillow", "pillow_in_memory", "ours_1", f"ours_{many}"}
    assert set(result["samples"]) == set(result["seconds"]) == set(result["cpu_seconds"]) == methods
    # The same whole batches from every method (one batch of 24 here).
    assert set(result["samples"].values()) == {24} and result["batch_size"] == 24
    per_core, ips = result["images_per_core_s"], result["images_per_s"]
    for m in methods:
        assert_quotient(ips[m], result["samples"][m], result["seconds"][m], f"images_per_s[{m}]")
        assert_quotient(per_core[m], result["samples"][m], result["cpu_seconds"][m], f"images_per_core_s[{m}]")
    ratio = result["ratio"]
    assert set(ratio) == {"vs_pillow", "vs_pillow_in_memory", f"vs_pillow_{many}_threads", "threads_scaling"}
    assert_quotient(ratio["vs_pillow"], per_core["ours_1"], per_core["pillow"], "ratio.vs_pillow")
    assert_quotient(ratio["vs_pillow_in_memory"], per_core["ours_1"], per_core["pillow_in_memory"], "in memory")
    assert_quotient(ratio[f"vs_pillow_{many}_threads"], per_core[f"ours_{many}"], per_core["pillow"], "threads")
    assert_quotient(ratio["threads_scaling"], ips[f"ours_{many}"], ips["ours_1"], "threads_scaling")
    assert result["targets"]["vs_pillow"] == TARGET_VS_PILLOW
    assert_met(result["met"]["vs_pillow"], ratio["vs_pillow"], TARGET_VS_PILLOW, "vs_pillow")
    b = result["bytes_per_image"]
    assert_quotient(result["bytes_ratio_shards_vs_raw"], b["shards"], b["raw"], "bytes ratio")
    assert result["petastorm"]["status"] == "not runnable here" and result["petastorm"]["reason"]
    assert list(tmp_path.iterdir()) == []  # nothing left where it ran
