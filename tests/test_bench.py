"""`shardline bench score` on the session's engines, dataset and model: every figure is
there and keeps its relations (a rate is rows over its own seconds, a ratio the quotient
of the two rates it names); nothing is claimed about speed."""

from __future__ import annotations

import json
import os

from pipelines.manifest import load_manifest

from .bench_figures import assert_met, assert_quotient
from .serving_helpers import trained_model


def test_bench_score_figures_keep_their_relations(spark, dask_client, prepared, tracking_uri, tmp_path):
    from benchmarks.score import run

    model = trained_model(prepared)
    result = run(0, workdir=str(tmp_path), progress=lambda msg: None, spark=spark,
                 dask_client=dask_client, dataset_dir=prepared.dataset_dir,
                 model_uri=model.model_uri, tracking_uri=tracking_uri)
    json.dumps(result)  # one JSON object
    assert result["benchmark"] == "score"
    manifest = load_manifest(prepared.dataset_dir)
    assert result["rows"] == sum(s.rows for s in manifest.splits.values())
    assert result["rows_scored"] == manifest.splits["train"].rows  # every method scored them all
    assert result["cores"] == len(os.sched_getaffinity(0))
    assert not list(tmp_path.iterdir())  # its scratch directory is gone

    secs, rps = result["seconds"], result["rows_per_s"]
    methods = {"spark", "dask", "predict_batch_udf", "limit_single_process", "processes"}
    raw = {"spark_raw", "dask_raw", "predict_batch_udf_raw", "processes_raw"}
    assert set(secs) == methods | raw and set(rps) == methods | raw | {"limit"}
    for m in methods:
        assert_quotient(rps[m], result["rows_scored"], secs[m], f"rows_per_s[{m}]")
    # Raw rows: every row of the dataset's raw files, through the model's transform.
    assert result["rows_scored_raw"] == result["rows"]
    for m in raw:
        assert_quotient(rps[m], result["rows_scored_raw"], secs[m], f"rows_per_s[{m}]")
    # The limit is one process's rate times the cores.
    assert_quotient(rps["limit_single_process"], rps["limit"], result["cores"], "limit / cores")
    assert_quotient(result["processes_vs_limit"], rps["processes"], rps["limit"], "processes_vs_limit")
    targets = result["targets"]
    assert set(result["met"]) == set(result["ratio_vs_limit"]) == {"spark", "dask"}
    for k in ("spark", "dask"):
        assert_quotient(result["ratio_vs_limit"][k], rps[k], rps["limit"], f"ratio_vs_limit[{k}]")
        assert_quotient(result["ratio_vs_processes"][k], rps[k], rps["processes"], f"ratio_vs_processes[{k}]")
        pbu = result["ratio_vs_predict_batch_udf"][k]
        assert_quotient(pbu, rps[k], rps["predict_batch_udf"], f"ratio_vs_predict_batch_udf[{k}]")
        assert_met(result["met"][k]["vs_limit"], result["ratio_vs_limit"][k], targets["vs_limit"], k)
        assert_met(result["met"][k]["vs_predict_batch_udf"], pbu, targets["vs_predict_batch_udf"], k)
        assert_met(result["met"][k]["vs_processes"], result["ratio_vs_processes"][k], targets["vs_processes"], k)
        raw_p, raw_pbu = result["raw_ratio_vs_processes"][k], result["raw_ratio_vs_predict_batch_udf"][k]
        assert_quotient(raw_p, rps[f"{k}_raw"], rps["processes_raw"], f"raw_ratio_vs_processes[{k}]")
        assert_quotient(raw_pbu, rps[f"{k}_raw"], rps["predict_batch_udf_raw"], f"raw_ratio_vs_pbu[{k}]")
        assert_met(result["met"][k]["raw_vs_processes"], raw_p, targets["vs_processes"], k)
        assert_met(result["met"][k]["raw_vs_predict_batch_udf"], raw_pbu, targets["vs_predict_batch_udf"], k)
