"""The Python API (shardline.prepare/train/score on the caller's own engines), the CLI's
--json results, and `shardline run` on the engines its settings name (#36.5, #40)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardline

from .conftest import shardline as shardline_cli
from .conftest import shardline_here
from .defaults_helpers import FEATURES, ROWS, small_dataset  # noqa: F401 (a fixture)
from .mlflow_store import env_without_store


def _dask_run_config(root: Path) -> Path:
    """The quickstart's data at small size, every stage on Dask (an embedded LocalCluster)."""
    data = root / "data"
    cfg = root / "dask.toml"
    cfg.write_text(f"""
[dask]
n_workers = 2
memory_limit = "2GiB"

[pipelines]
engine = "dask"
dataset_dir = "{data / 'dataset'}"

[pipelines.source]
format = "synthetic"
path = "{data / 'raw'}"

[pipelines.source.synthetic]
rows = 3000
partitions = 2

[pipelines.features]
key = "key"
label = "label"
numeric = ["x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7"]
categorical = ["color"]

[training]
launcher = "dask"
world_size = 2
epochs = 1
batch_size = 64
checkpoint_dir = "{data / 'checkpoints'}"

[tracking]
experiment = "dask-run"
registered_model = "dask-run"

[serving]
output_dir = "{data / 'scores'}"
""")
    return cfg


@pytest.mark.slow
def test_run_on_dask_starts_no_spark(tmp_path, new_store):
    """#40: prepare, training and scoring all on Dask; Spark never starts. The check is real:
    JAVA_HOME names no Java, so any Spark this process or its children started would fail
    (the control below shows it does)."""
    cfg = _dask_run_config(tmp_path)
    new_store(tmp_path / "mlflow.db")  # the run's default store (cwd's), empty: made, not migrated anew
    no_java = {"JAVA_HOME": str(tmp_path / "no-java")}
    # The control runs beside the job (each is mostly one busy core), in a folder of its own.
    (tmp_path / "control").mkdir()
    control_cfg = _dask_run_config(tmp_path / "control")
    base = env_without_store()  # as conftest.shardline
    control = subprocess.Popen(
        [sys.executable, "-m", "shardline.jobs.cli", "prepare", str(control_cfg), "--engine", "spark"],
        cwd=tmp_path / "control", env={**base, **no_java}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # serving.engine by --set, as the issue ran it; the other two from the file.
        proc = shardline_cli("run", str(cfg), "--set", "serving.engine=dask", "--json", cwd=tmp_path, env=no_java)
        _, control_err = control.communicate(timeout=600)
    finally:
        if control.poll() is None:
            control.kill()
            control.wait()
    assert control.returncode != 0 and "no-java/bin/java" in control_err, control_err[-2000:]
    assert not (tmp_path / "control" / "data" / "dataset" / "manifest.json").exists()

    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout is the result alone
    assert result["prepare"]["engine"] == "dask"
    assert result["train"]["launcher"] == "dask"
    assert result["score"]["engine"] == "dask"
    assert "with dask" in proc.stderr and "on dask" in proc.stderr
    assert "Starting Spark" not in proc.stderr and "Spark master" not in proc.stderr
    test_rows = result["prepare"]["splits"]["test"]["rows"]
    assert result["score"]["rows"] == test_rows > 0
    assert result["train"]["model_uri"] == "models:/dask-run/1"

    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result["train"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["launcher"] == "dask"
    import pyarrow.parquet as pq

    assert pq.read_table(result["score"]["version_dir"]).num_rows == test_rows


def _small_config(folder: Path, raw: Path, dask_address: str) -> Path:
    numeric = ", ".join(f"'{c}'" for c in FEATURES["numeric"])
    cfg = folder / "job.toml"
    cfg.write_text(
        f"[dask]\naddress = '{dask_address}'\n"
        f"[pipelines]\ndataset_dir = '{folder / 'dataset'}'\n"
        f"[pipelines.source]\nformat = 'parquet'\npath = '{raw}'\n"
        f"[pipelines.features]\nkey = 'key'\nlabel = 'label'\nnumeric = [{numeric}]\ncategorical = []\n"
        f"[tracking]\ntracking_uri = 'sqlite:///{folder}/mlflow.db'\nregistered_model = 'json-model'\n"
        f"[training]\nworld_size = 2\nbatch_size = 64\nepochs = 1\ncheckpoint_dir = '{folder / 'ckpt'}'\n"
        f"[serving]\noutput_dir = '{folder / 'out'}'\n"
    )
    return cfg


def test_json_results_of_prepare_train_score_and_status(small_dataset, dask_client, new_store,  # noqa: F811
                                                        tmp_path):
    """--json: the result object alone on stdout, for each command (#40.4)."""
    raw = Path(small_dataset.source.path)
    cfg = _small_config(tmp_path, raw, dask_client.scheduler.address)
    new_store(tmp_path / "mlflow.db")  # the config's tracking_uri, empty

    proc = shardline_here("prepare", str(cfg), "--engine", "dask", "--json", "--json-file", "prepared.json",
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    prepared = json.loads(proc.stdout)
    # --json-file (#46): the same document in a file, for spark-submit, whose stdout holds stderr too.
    assert json.loads((tmp_path / "prepared.json").read_text()) == prepared
    assert prepared["engine"] == "dask" and prepared["dataset_dir"] == str(tmp_path / "dataset")
    assert sum(s["rows"] for s in prepared["splits"].values()) == ROWS
    assert "rows in" in proc.stderr  # the summary still goes to stderr

    proc = shardline_here("train", str(cfg), "--launcher", "local", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    trained = json.loads(proc.stdout)
    assert trained["launcher"] == "local" and trained["model_uri"] == "models:/json-model/1"
    assert trained["run_id"] and "val_loss" in trained["metrics"]

    proc = shardline_here("score", str(cfg), "--model", trained["model_uri"], "--engine", "dask", "--json",
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    scored = json.loads(proc.stdout)
    assert scored["engine"] == "dask" and scored["rows"] == prepared["splits"]["test"]["rows"]
    assert scored["model_version"] == "1" and scored["version_dir"].endswith("model=json-model/version=1")

    again = shardline_here("score", str(cfg), "--model", trained["model_uri"], "--engine", "dask", "--json",
                           cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    nothing = json.loads(again.stdout)
    assert nothing["engine"] is None and nothing["rows"] == 0 and nothing["files_skipped"] == scored["files_scored"]
    assert nothing["note"].startswith("nothing to score")

    # A real process and a real pipe, as `shardline score --status OUT --json | python -c ...`.
    status = shardline_cli("score", "--status", str(tmp_path / "out"), "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert [(v["model_name"], v["model_version"], v["rows"]) for v in st["versions"]] == [
        ("json-model", "1", scored["rows"])
    ]
    assert st["holder"] is None
    # --json-file without --json: the table for a person on stdout, the document in the file.
    table = shardline_here("score", "--status", str(tmp_path / "out"), "--json-file", "status.json", cwd=tmp_path)
    assert table.returncode == 0 and "json-model" in table.stdout and not table.stdout.startswith("{"), table.stdout
    assert json.loads((tmp_path / "status.json").read_text()) == st
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["prepared.json", "status.json"]  # no temp file left


def test_api_on_the_callers_engines(spark, dask_client, small_dataset, tracking_uri, new_store,  # noqa: F811
                                    tmp_path):
    """shardline.prepare/train/score use the SparkSession and Dask client given, choose the
    engine by them where the config writes none, honour one it writes, and stop neither."""
    base = {
        "pipelines": {"dataset_dir": str(tmp_path / "dataset"),
                      "source": {"format": "parquet", "path": small_dataset.source.path},
                      "features": FEATURES},
        "tracking": {"tracking_uri": new_store(tmp_path / "mlflow.db"), "registered_model": "api-model"},
        "training": {"world_size": 2, "batch_size": 64, "epochs": 1, "checkpoint_dir": str(tmp_path / "ckpt")},
        "serving": {"output_dir": str(tmp_path / "out")},
    }
    prepared = shardline.prepare(base, spark=spark)
    assert isinstance(prepared, shardline.PrepareResult)
    assert prepared.engine == "spark" and prepared.manifest.engine["name"] == "spark"
    assert sum(s.rows for s in prepared.manifest.splits.values()) == ROWS

    # Written settings win over the engines given: pipelines.engine = 'dask' with a SparkSession.
    again = shardline.prepare(base, {"pipelines.engine": "dask"}, spark=spark, client=dask_client)
    assert again.engine == "dask" and again.manifest.engine["name"] == "dask"
    assert again.manifest.sequence == prepared.manifest.sequence + 1

    trained = shardline.train(base, client=dask_client)  # training.launcher unset: the client's
    assert isinstance(trained, shardline.TrainResult)
    assert trained.launcher == "dask" and trained.model_uri == "models:/api-model/1"
    assert trained.model_version == "1" and trained.run_id

    scored = shardline.score(base, client=dask_client, model_uri=trained.model_uri)
    assert isinstance(scored, shardline.ScoreResult)
    assert scored.engine == "dask" and scored.rows == again.manifest.splits["test"].rows
    assert scored.model_version == "1"

    # The config's own store did not become the caller's: MLflow's global URI and the
    # MLFLOW_TRACKING_URI it copies it into are as they were (a later train would log there).
    import mlflow

    assert os.environ["MLFLOW_TRACKING_URI"] == tracking_uri
    assert mlflow.get_tracking_uri() == tracking_uri
    assert spark.range(3).count() == 3  # neither engine was stopped
    assert dask_client.status == "running" and dask_client.submit(sum, [1, 2]).result() == 3


def test_api_refuses_what_it_cannot_honour(tmp_path):
    from shardline.foundation.errors import ConfigError

    with pytest.raises(ConfigError, match="refit goes with append"):
        shardline.prepare(None, refit=True)
    with pytest.raises(ConfigError, match="no model: pass model_uri or set serving.model_uri"):
        shardline.score({"serving": {"engine": "dask", "output_dir": str(tmp_path / "out")}},
                        {"pipelines.dataset_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="unknown setting 'training.epochz'"):
        shardline.load_config(None, {"training.epochz": 3})
    assert not any(tmp_path.iterdir())


def test_import_shardline_pulls_in_no_engine():
    code = ("import sys, shardline; shardline.load_config; "
            "print(sorted(m for m in ('pyspark', 'mlflow', 'torch', 'distributed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert out.stdout.strip() == "[]"
