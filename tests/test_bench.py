"""`shardline bench score` at a tiny size: the figures are there and positive (no timing claims)."""

from __future__ import annotations

import json


def test_bench_score_tiny(spark, tmp_path):
    # `spark`: the session's own SparkSession, which the benchmark's getOrCreate reuses.
    from benchmarks.score import run

    result = run(20_000, workdir=str(tmp_path), progress=lambda msg: None)
    json.dumps(result)  # one JSON object
    assert result["benchmark"] == "score"
    assert 0 < result["rows_scored"] < 20_000
    methods = {"spark", "dask", "predict_batch_udf", "limit_single_process", "processes"}
    assert set(result["seconds"]) == methods
    assert set(result["rows_per_s"]) == methods | {"limit"}
    for ratios in ("ratio_vs_limit", "ratio_vs_predict_batch_udf", "ratio_vs_processes"):
        assert set(result[ratios]) == {"spark", "dask"}
    figures = [*result["seconds"].values(), *result["rows_per_s"].values(),
               *result["ratio_vs_limit"].values(), *result["ratio_vs_predict_batch_udf"].values(),
               *result["ratio_vs_processes"].values(), result["processes_vs_limit"], result["cores"]]
    assert all(isinstance(v, (int, float)) and v > 0 for v in figures)
    assert result["targets"] == {"vs_limit": 0.9, "vs_predict_batch_udf": 1.5}
    assert set(result["met"]) == {"spark", "dask"}
    assert all(isinstance(v, bool) for m in result["met"].values() for v in m.values())
