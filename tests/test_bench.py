"""`shardline bench score` on the session's engines, dataset and model: every figure is
there and keeps its relations (a rate is rows over its own seconds, a ratio the quotient
of the two rates it names); nothing is claimed about speed."""

from __future__ import annotations

import json
import os

import pytest

from shardline.pipelines.manifest import load_manifest

from .bench_figures import assert_met, assert_quotient
from .serving_helpers import trained_model


@pytest.mark.slow
def test_bench_score_figures_keep_their_relations(spark, dask_client, prepared, tracking_uri, tmp_path):
    """Full tier only (`make test-all`, marker `slow`): the benchmark scores the dataset by every
    method it compares, each on its engine (about 50 CPU-s); test_measure_rounds below keeps its
    arithmetic in the quick tier."""
    from shardline.benchmarks.score import run

    model = trained_model(prepared)
    result = run(0, workdir=str(tmp_path), progress=lambda msg: None, spark=spark,
                 dask_client=dask_client, dataset_dir=prepared.dataset_dir,
                 model_uri=model.model_uri, tracking_uri=tracking_uri, rounds=1)
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
    # One round: every method's figure is its one run (test_measure_rounds: the median of more).
    assert result["rounds"] == 1 and set(result["seconds_runs"]) == methods | raw
    for m, runs in result["seconds_runs"].items():
        assert runs == [secs[m]], (m, runs, secs[m])
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


def test_measure_rounds_runs_every_method_once_per_round_and_keeps_its_median(tmp_path):
    from shardline.benchmarks.score import measure_rounds

    order, seconds = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 9.0, 7.0])}

    def method(name):
        def measure(out):
            order.append(name)
            out.mkdir(parents=True)  # each run writes into a directory of its own ...
            (out / "part").write_text("x")
            return 10, next(seconds[name])
        return measure

    median, rows, runs = measure_rounds({"a": method("a"), "b": method("b")}, tmp_path / "runs", 3,
                                        progress=lambda msg: None)
    assert order == ["a", "b"] * 3  # round by round, not a's three runs then b's
    assert median == {"a": 2.0, "b": 7.0} and rows == {"a": 10, "b": 10}
    assert runs == {"a": [3.0, 1.0, 2.0], "b": [5.0, 9.0, 7.0]}
    assert not list((tmp_path / "runs").iterdir())  # ... removed after it


def test_measure_rounds_refuses_a_method_whose_rows_change(tmp_path):
    from shardline.benchmarks.score import measure_rounds

    rows = iter([10, 9])
    with pytest.raises(RuntimeError, match="b scored 9 rows, 10 in its first run"):
        measure_rounds({"b": lambda out: (next(rows), 1.0)}, tmp_path, 2, progress=lambda msg: None)
