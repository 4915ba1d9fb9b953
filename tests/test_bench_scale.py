"""`shardline bench scale`, `bench shapes` and `shardline plan --hosts`: their arithmetic on
chosen figures (quick tier), and real runs at tiny sizes (full tier) checked for what must
hold on any machine: every rate its count over its seconds, every ratio the quotient of the
figures it names, every `met` what its figures and target say; never a speed (#56)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from shardline.benchmarks import scale, shapes
from shardline.benchmarks.scale_data import MARKER

from .conftest import shardline


def _stage(seconds: float, rows: int, driver: float, ranks: list[float]) -> dict:
    return {"seconds": seconds, "rows": rows, "rows_per_s": rows / seconds, "disk_written_bytes": 0, "cpu_s": seconds,
            "peak_rss_mb": {"driver": [driver], "dask_worker": ranks}, "tree_peak_rss_mb": driver + sum(ranks)}


def _leg(rows: int, seconds: float, driver: float, rank: float, wait: float = 0.01, cores: int = 2) -> dict:
    stages = {k: _stage(seconds, rows, driver, [rank, rank - 10]) for k in scale.STAGES}
    stages["train"].update(data_wait=wait, data_wait_by_rank=[wait, wait / 2], step_s=0.01, epoch_steps=9,
                           rank_added_mb=[rank - 400, rank - 410])
    return {"engine": "dask", "cores": cores, "rows": rows, "stages": stages, "splits": {}}


class _Forecast:
    """The three stage figures check_forecast reads from a shardline.forecasting.Forecast."""

    def __init__(self, seconds: float):
        stage = type("Stage", (), {"seconds": seconds, "worker_mb": 300.0, "driver_mb": 150.0, "parts": {},
                                   "cpu_s": 2 * seconds})
        self.prepare = self.train_steps = self.score = self.epoch = stage


def test_the_summary_is_its_figures_arithmetic():
    small, big = _leg(1000, 10.0, 200.0, 500.0), _leg(100_000, 700.0, 230.0, 520.0, wait=0.08)
    for leg, f in ((small, 9.0), (big, 1000.0)):
        leg["forecast"] = scale.check_forecast(_Forecast(f), leg)
    assert small["forecast"]["ratio_run_vs_forecast"]["prepare"] == pytest.approx(10 / 9, rel=1e-3)
    assert small["forecast"]["within"]["prepare"] and not big["forecast"]["within"]["prepare"]  # 0.7x: off
    assert small["forecast"]["seconds"]["total"] == pytest.approx(27.0)
    r = scale.summarize(100_000, 1000, 4, {}, {}, [small, big])
    g = r["growth"]["dask"]
    assert g["prepare"]["seconds"] == pytest.approx(70.0) and g["prepare"]["rows_per_s"] == pytest.approx(100 / 70, rel=1e-3)
    assert g["driver_peak_rss"] == pytest.approx(1.15) and g["rank_added_rss"] == pytest.approx(120 / 100)
    met = r["met"]["dask"]
    assert met == {"under_30_min": False, "data_wait": False, "driver_growth": True, "rank_growth": True,
                   "forecast": False}  # 3 x 700 s > 1800 s; 8% > 5%
    assert len(r["missed"]) == 3
    assert "prepare 700 s, train 700 s, score 700 s" in r["missed"][0]
    assert "waited for data 8.0%" in r["missed"][1] and "2 core(s) 100,000 rows prepare 0.70x" in r["missed"][2]


@pytest.mark.slow
def test_bench_scale_at_a_tiny_size(tmp_path):
    """Full tier only: it starts Spark and Dask (2 cores each), trains and scores on each at two
    sizes (~30 s idle). The 1-core legs (--no-one-core skips them) and the warm-up job on each
    engine (--no-warm-up) run the same code with another core count or unreported; the quick
    tier checks the arithmetic on chosen figures above."""
    data = tmp_path / "data"
    r = _bench_json(tmp_path, "scale", "--rows", "40000", "--data-dir", str(data), "--steps", "6", "--no-one-core",
                    "--no-warm-up")
    assert r["warm_up"] is False
    assert {(leg["engine"], leg["cores"], leg["rows"]) for leg in r["legs"]} == {
        (e, 2, n) for e in ("spark", "dask") for n in (20_000, 40_000)}
    for leg in r["legs"]:
        st = leg["stages"]
        assert st["prepare"]["rows"] == leg["rows"] and st["train"]["samples"] == 6 * 512
        assert st["score"]["rows"] == leg["splits"]["test"]
        for s in st.values():
            n = s.get("rows") or s["samples"]
            assert s["rows_per_s"] == pytest.approx(n / s["seconds"])
            assert s["peak_rss_mb"]["driver"] and s["disk_written_bytes"] >= 0
        ranks = st["train"]["peak_rss_mb"]["spark_python" if leg["engine"] == "spark" else "dask_worker"]
        assert len(ranks) >= leg["cores"]  # every rank's process was seen
        assert st["prepare"]["output_bytes"] > 0 and st["prepare"]["disk_written_bytes"] > 0
        f = leg["forecast"]
        for k in scale.STAGES:
            assert f["ratio_run_vs_forecast"][k] == pytest.approx(st[k]["seconds"] / f["seconds"][k], rel=1e-3)
            assert f["within"][k] == (abs(f["ratio_run_vs_forecast"][k] - 1) <= scale.FORECAST_TOLERANCE)
    for e, g in r["growth"].items():
        small, big = (next(x for x in r["legs"] if (x["engine"], x["cores"], x["rows"]) == (e, 2, n))
                      for n in (20_000, 40_000))
        assert g["train"]["seconds"] == pytest.approx(big["stages"]["train"]["seconds"] / small["stages"]["train"]["seconds"], rel=1e-3)
    assert len(r["missed"]) == sum(not ok for checks in r["met"].values() for ok in checks.values())
    # The raw data is kept (its marker says what it holds); the legs' outputs are not.
    assert json.loads((data / "raw-40000" / MARKER).read_text())["rows"] == 40_000
    assert not (data / "work").exists()


@pytest.mark.slow
def test_bench_shapes_at_a_tiny_size(tmp_path):
    """Full tier only: it prepares six inputs on Spark and on Dask (~2 min idle)."""
    r = _bench_json(tmp_path, "shapes", "--files", "300", "--rows-per-file", "20", "--skew-rows", "20000",
                    "--vector-rows", "3000", "--width", "64", "--data-dir", str(tmp_path / "data"))
    f = r["files"]
    assert f["driver"]["files"] == 300 and f["few_files_driver"]["files"] == shapes.FEW_FILES
    assert f["same_shards"] and r["skew"]["same_shards"] and r["vectors"]["same_shards"]
    for e in ("spark", "dask"):
        assert f["ratio_small_vs_few"][e] == pytest.approx(f["small"][e]["seconds"] / f["few"][e]["seconds"], rel=1e-3)
        assert f["met_within_2x"][e] == (f["ratio_small_vs_few"][e] <= shapes.SMALL_FILES_X)
        bad = f["bad_file"][e]
        assert bad["names_the_file"] and bad["nothing_written"], bad
        assert f["bad_file"]["file"] in bad["error"] and shapes.BAD_VALUE in bad["error"]
        assert f["small"][e]["rows"] == f["few"][e]["rows"] == 6000
    rows = r["skew"]["runs"]["dask"]["shard_rows"]
    for split, spread in r["skew"]["spread"].items():
        assert spread == pytest.approx(max(rows[split]) / min(rows[split]) - 1, rel=1e-3)
    assert r["skew"]["met_spread"] == all(s <= shapes.SHARD_SPREAD for s in r["skew"]["spread"].values())
    assert r["vectors"]["runs"]["spark"]["rows"] == 3_000


@pytest.mark.slow
def test_plan_forecast_on_the_cli_is_stored_and_logged_by_the_next_run(tmp_path, tracking_uri):
    """Full tier only: the forecast measures a sample (~10 s), then a training run on the
    embedded Dask cluster logs it (~1 min idle)."""
    from shardline.benchmarks.scale_data import quickstart_csv
    from .cli_inprocess import run_cli

    raw = quickstart_csv(tmp_path / "data", 60_000, lambda _: None, rows_per_file=20_000)
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f"[pipelines]\ndataset_dir = '{tmp_path / 'ds'}'\nengine = 'dask'\n"
        f"[pipelines.source]\nformat = 'csv'\npath = '{raw}'\n"
        "[pipelines.features]\nkey = 'key'\nlabel = 'label'\nnumeric = ['x0', 'x1', 'x2', 'x3', 'x4', 'x5', 'x6', 'x7']\n"
        "categorical = ['color']\n"
        f"[training]\nlauncher = 'dask'\nworld_size = 2\nepochs = 1\nbatch_size = 512\nhidden = [16]\n"
        f"checkpoint_dir = '{tmp_path / 'ckpt'}'\n[tracking]\ntracking_uri = '{tracking_uri}'\n")
    code, out, err = run_cli(["plan", str(cfg), "--hosts", "1", "--cores", "2", "--sample-rows", "20000", "--json"],
                             tmp_path)
    assert code == 0, err
    f = json.loads(out)
    assert f["cluster"] == {"hosts": 1, "cores": 2, "gpus": 0} and f["engine"] == "dask"
    m = f["measured"]
    assert m["input"]["files"] == 3 and m["input"]["rows_estimated"] and m["prepare"]["rows"] == 20_000
    assert abs(m["input"]["rows"] - 60_000) <= 600  # from the bytes and the sample's bytes per row
    assert f["layout"]["ranks"] == 2 and f["total_s"] == pytest.approx(
        f["prepare"]["seconds"] + f["epoch"]["seconds"] + f["score"]["seconds"])
    stored = Path(f["stored"])
    assert stored == tmp_path / "ds" / "_forecast.json" and json.loads(stored.read_text())["rows"] == f["rows"]
    for command in ("prepare", "train"):
        code, _, err = run_cli([command, str(cfg)], tmp_path)
        assert code == 0, err
    db = tracking_uri.removeprefix("sqlite:///")
    with sqlite3.connect(db) as c:
        params = dict(c.execute("select key, value from params where key like 'forecast_%'").fetchall())
    assert params["forecast_cluster"] == "1 x 2 cores"
    assert float(params["forecast_epoch_s"]) == pytest.approx(f["epoch"]["seconds"], abs=0.05)


def _bench_json(tmp_path: Path, *args: str) -> dict:
    """`shardline bench ARGS --json` in a process of its own, as a user runs it: the bench
    starts Spark at 1 and 2 cores, stopping the process's session first, which in pytest's
    process would be the session's own (every later Spark test would fail)."""
    proc = shardline("bench", *args, "--json", cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
