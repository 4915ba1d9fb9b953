"""`shardline bench prepare` at a tiny size: the native baselines do the same work, and the
figures are the quotients they claim to be (never a claim about speed).

Full tier only (`make test-all`, marker `slow`): the benchmark prepares the same data on both
engines and with the native baselines, each timed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from shardline.benchmarks.prepare import JOBS, bench_config, run
from shardline.benchmarks.prepare_native import native_dask, native_pyarrow, native_spark
from shardline.engines import DaskEngine
from shardline.pipelines.synthetic import generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def raw(dask_client, tmp_path_factory):
    cfg = bench_config(tmp_path_factory.mktemp("bench-prepare"), 6000, partitions=3)
    generate(DaskEngine(dask_client), cfg.source.synthetic, cfg.source.path)
    return cfg


def _check_output(out: Path, rows: int, hive: bool):
    """Every row once; each file sorted by key; train numerics standardised; categories indexed."""
    files = sorted(out.rglob("*.parquet"))
    tables = {f: pq.read_table(f, columns=["key", "features", "label"]) for f in files}
    keys = np.concatenate([t.column("key").to_numpy() for t in tables.values()])
    assert sorted(keys.tolist()) == list(range(rows))
    for t in tables.values():
        assert (np.diff(t.column("key").to_numpy()) > 0).all()
    train = [t for f, t in tables.items() if ("split=train" in str(f) if hive else f.name == "train.parquet")]
    x = np.concatenate([np.stack(t.column("features").to_numpy(zero_copy_only=False)) for t in train])
    assert x.shape[1] == 9
    np.testing.assert_allclose(x[:, :8].mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(x[:, :8].std(0), 1, atol=1e-4)
    assert set(np.unique(x[:, 8])) <= set(range(1, 7))
    if hive:  # shard folders: 80/10/10 by the key hash, shard counts a multiple of world size
        splits = pads.dataset(out, partitioning="hive").to_table(columns=["split", "shard"])
        counts = {s: splits.column("split").to_pylist().count(s) for s in ("train", "val", "test")}
        assert 0.75 < counts["train"] / rows < 0.85 and counts["val"] and counts["test"]


def test_the_native_baselines_do_the_same_work(spark, dask_client, raw, tmp_path):
    native_spark(spark, raw.source.path, str(tmp_path / "spark"), raw)
    _check_output(tmp_path / "spark", 6000, hive=True)
    native_dask(raw.source.path, str(tmp_path / "dask"), raw)
    _check_output(tmp_path / "dask", 6000, hive=True)
    native_pyarrow(raw.source.path, tmp_path / "pyarrow", raw)
    _check_output(tmp_path / "pyarrow", 6000, hive=False)


def test_bench_prepare_figures_are_the_quotients_they_name(spark, dask_client, tmp_path):
    """On the session's engines (`run` uses the active Spark session and the Dask client it
    is given): the figures are the same, without a local Dask cluster of its own."""
    r = run(rows=6000, rounds=2, workdir=str(tmp_path), progress=lambda _: None, dask_client=dask_client)
    assert set(r["seconds"]) == set(JOBS)
    for job in JOBS:
        assert len(r["seconds_per_round"][job]) == 2
        assert r["seconds"][job] == min(r["seconds_per_round"][job])
        assert r["mb_per_s"][job] == pytest.approx(r["input_mb"] / r["seconds"][job], rel=0.01)
    for engine in ("spark", "dask"):
        ratio = r["mb_per_s"][engine] / r["mb_per_s"][f"{engine}_native"]
        assert r["ratio_vs_native"][engine] == pytest.approx(ratio, rel=0.02)
        assert r["ratio_vs_pyarrow"][engine] == pytest.approx(r["mb_per_s"][engine] / r["mb_per_s"]["pyarrow"], rel=0.02)
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone
