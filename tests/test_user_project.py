"""A user's own project beside shardline (#36.6): its `training/` and `jobs/` packages are
its own, and shardline (installed under the one name `shardline`) neither shadows them nor
is shadowed by them, from Python and from the `shardline` command run in that folder.

Full tier only (`make test-all`, marker `slow`): the project's own commands and `shardline` run in
processes of their own, and the cluster tests on the session's clusters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .defaults_helpers import FEATURES, small_dataset  # noqa: F401 (a fixture)
from .mlflow_store import env_without_store

pytestmark = pytest.mark.slow

MYMODEL = '''"""The user's model factory."""
from pathlib import Path

import torch.nn as nn

HERE = Path(__file__).resolve().parents[1]


def build(inputs, width=3, classes=3, hidden=16, **kw):
    if HERE.is_dir():  # the project's folder; a shipped copy is inside a zip on a worker
        with open(HERE / "built-by-mymodel.txt", "a") as f:  # proof that this file's factory built it
            f.write("built\\n")
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, classes))
'''

LOSSES = '''"""The user's loss and metric: fn(output, target)."""
import torch.nn.functional as F


def shifted_ce(output, target):
    """Cross-entropy + 100: the task's gradients, a val_loss that can only be this one's."""
    return F.cross_entropy(output, target.long()) + 100.0


def ce(output, target):
    return F.cross_entropy(output, target.long()).item()
'''


def _project(root: Path) -> Path:
    project = root / "myproject"
    (project / "training").mkdir(parents=True)
    (project / "training" / "__init__.py").write_text("")
    (project / "training" / "mymodel.py").write_text(MYMODEL)
    (project / "training" / "losses.py").write_text(LOSSES)
    (project / "jobs").mkdir()
    (project / "jobs" / "__init__.py").write_text("WHOSE = 'the user'\n")
    return project


def _env() -> dict:
    return env_without_store()


def test_a_user_project_with_its_own_training_and_jobs(small_dataset, tmp_path):  # noqa: F811
    project = _project(tmp_path)
    env = _env()

    # Python in the project's folder: its packages are its own, shardline's are shardline's.
    code = ("import shardline, shardline.api, shardline.training.models.builtin, shardline.jobs.cli, training.mymodel, jobs\n"
            "print(training.mymodel.__file__); print(jobs.WHOSE)\n"
            "print(shardline.training.models.builtin.__file__); print(callable(shardline.train))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    mine, whose, theirs, api = proc.stdout.splitlines()
    assert Path(mine) == project / "training" / "mymodel.py"
    assert whose == "the user"
    assert project not in Path(theirs).parents and Path(theirs).name == "builtin.py"
    assert api == "True"

    # The `shardline` command, as installed (its sys.path[0] is its bin folder, not the project).
    command = str(Path(sys.executable).with_name("shardline"))
    proc = subprocess.run([command, "--help"], cwd=project, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "  train " in proc.stdout, proc.stderr

    numeric = ", ".join(f"'{c}'" for c in FEATURES["numeric"])
    (project / "job.toml").write_text(
        f"[pipelines]\ndataset_dir = '{small_dataset.dataset_dir}'\n"
        f"[pipelines.features]\nkey = 'key'\nlabel = 'label'\nnumeric = [{numeric}]\ncategorical = []\n"
        "[training]\nlauncher = 'local'\nworld_size = 2\nbatch_size = 64\nepochs = 1\n"
        "[training.model_args]\nwidth = 3\nclasses = 3\n"
        "[tracking]\nexperiment = 'mine'\nregistered_model = 'mymodel'\n"
    )
    proc = subprocess.run(
        [command, "train", "job.toml", "--set", "training.model='training.mymodel:build'", "--json"],
        cwd=project, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["model_uri"] == "models:/mymodel/1" and result["launcher"] == "local"
    assert (project / "built-by-mymodel.txt").read_text().count("built") >= 1

    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_run(result["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["model"] == "training.mymodel:build"


# ---------------------------------------------------------------- `shardline run` on the engines
# From the project's folder, as a user runs it: the command prepares the raw rows, trains the
# project's model with its loss, registers it and scores the test split, on Spark Connect and
# on a Dask CLI cluster, whose executors and workers have neither shardline nor the project's
# `training` package: it reaches them only as the job's shipped code (shardline/foundation/code_travel.py).
# The session's MLflow store, its tables made once (a new SQLite store takes seconds to make).
RUN_SETS = ("--set", "training.model='training.mymodel:build'", "--set", "training.loss='training.losses:shifted_ce'",
            "--set", "training.metrics=['training.losses:ce']")


def _run_job(project: Path, raw: str, tracking_uri: str, name: str) -> None:
    """run.toml: `shardline run` of the small dataset's raw rows into model `name`, every path
    absolute (the executors and workers are other processes: relative paths are refused)."""
    numeric = ", ".join(f"'{c}'" for c in FEATURES["numeric"])
    out = project / "out"
    (project / "run.toml").write_text(
        f"[pipelines]\ndataset_dir = '{out / 'dataset'}'\n"
        f"[pipelines.source]\nformat = 'parquet'\npath = '{raw}'\n"
        f"[pipelines.features]\nkey = 'key'\nlabel = 'label'\nnumeric = [{numeric}]\ncategorical = []\n"
        "[pipelines.layout]\nworld_size = 2\n"
        f"[training]\nworld_size = 2\nbatch_size = 64\nepochs = 1\ncheckpoint_dir = '{out / 'checkpoints'}'\n"
        "[training.model_args]\nwidth = 3\nclasses = 3\n"
        f"[tracking]\ntracking_uri = '{tracking_uri}'\nexperiment = 'mine'\nregistered_model = '{name}'\n"
        f"[serving]\nsplit = 'test'\noutput_dir = '{out / 'scores'}'\n"
    )


def _check_run(project: Path, proc, tracking_uri: str, name: str, engine: str) -> dict:
    """Trained on `engine`, registered as version 1 of `name`, its run's params and metrics
    the project's, and every row of the test split scored by that version; the result."""
    import pyarrow.parquet as pq
    from mlflow.tracking import MlflowClient

    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    train, score = result["train"], result["score"]
    assert train["launcher"] == engine and score["engine"] == engine and result["prepare"]["engine"] == engine
    assert train["model_uri"] == f"models:/{name}/1"
    client = MlflowClient(tracking_uri)
    version = client.get_model_version(name, "1")
    assert version.run_id == train["run_id"] and version.status == "READY"
    run = client.get_run(train["run_id"])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["model"] == "training.mymodel:build" and params["loss"] == "training.losses:shifted_ce", params
    # val_loss is the project's loss (cross-entropy + 100), val_ce its metric on the same rows.
    metrics = run.data.metrics
    assert metrics["val_loss"] - metrics["val_ce"] == pytest.approx(100.0, abs=1e-3), metrics
    # The driver checked the factory from the project's folder (the workers built it from the zip).
    assert (project / "built-by-mymodel.txt").read_text().count("built") >= 1

    test_rows = result["prepare"]["splits"]["test"]["rows"]
    assert score["rows"] == test_rows > 0 and score["model_version"] == "1"
    scores = pq.read_table(score["version_dir"])
    assert scores.num_rows == test_rows and set(scores.column("model_version").to_pylist()) == {"1"}
    assert set(scores.column("prediction").to_pylist()) <= {0, 1, 2}
    return result


@pytest.mark.slow
def test_run_on_spark_connect_trains_registers_and_scores_the_projects_model(
    connect_server, connect_cli, small_dataset, tracking_uri, tmp_path  # noqa: F811
):
    """In the session's Connect client process (a new one would start its own executors'
    Pythons on the server); the project's folder is the command's working folder, as for a
    user's `shardline run` there."""
    project = _project(tmp_path)
    _run_job(project, small_dataset.source.path, tracking_uri, "mymodel-connect")
    proc = connect_cli.run("run", "run.toml", *RUN_SETS, "--set", f"spark.remote='{connect_server.url}'",
                           "--json", cwd=project, timeout=900)
    _check_run(project, proc, tracking_uri, "mymodel-connect", "spark")


@pytest.mark.slow
@pytest.mark.cluster
def test_run_on_a_dask_cluster_and_mlflow_models_serve_answer_with_the_projects_model(
    dask_cli_cluster, small_dataset, tracking_uri, tmp_path  # noqa: F811
):
    """The `shardline` command in the project's folder, on the session's Dask CLI cluster;
    then `mlflow models serve` of the model it registered, in another folder: the project's
    code comes from the registered model alone, and raw rows get the batch job's answers."""
    import numpy as np
    import pyarrow.parquet as pq

    from .serving_helpers import post, served

    project = _project(tmp_path)
    _run_job(project, small_dataset.source.path, tracking_uri, "mymodel-dask")
    engines = {"dask.address": f"'{dask_cli_cluster.address}'", "pipelines.engine": "'dask'",
               "training.launcher": "'dask'", "serving.engine": "'dask'"}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("shardline")), "run", "run.toml", *RUN_SETS,
         *(a for k, v in engines.items() for a in ("--set", f"{k}={v}")), "--json"],
        cwd=project, env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    result = _check_run(project, proc, tracking_uri, "mymodel-dask", "dask")

    batch = pq.read_table(result["score"]["version_dir"]).sort_by("key").slice(0, 16)
    keys = batch.column("key").to_pylist()
    raw = pq.read_table(small_dataset.source.path).to_pandas().set_index("key").loc[keys].reset_index()
    rows = raw[["key", *FEATURES["numeric"]]].to_dict("records")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with served(result["train"]["model_uri"], tracking_uri, elsewhere) as base:
        got = post(f"{base}/invocations", {"dataframe_records": rows})["predictions"]
    assert [r["key"] for r in got] == keys
    assert [r["prediction"] for r in got] == batch.column("prediction").to_pylist()
    probs = np.stack(batch.column("probabilities").to_numpy(zero_copy_only=False))
    answered = np.array([[r[f"prob_{i}"] for i in range(probs.shape[1])] for r in got], dtype=np.float32)
    np.testing.assert_allclose(answered, probs, rtol=1e-6, atol=1e-7)
