"""The worked example (#36.7): examples/own_model's notebook functions on the session's
Spark and Dask, run from the example's folder as a user would, and its job.toml through
the CLI."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from .conftest import shardline_here

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_model"


@contextmanager
def _checkout(name: str, folder: Path, package: str | None):
    """A copy of examples/<name> at `folder`, as a user's own checkout: what runs there
    (MLflow's ./mlruns among it) stays out of the repository. Afterwards sys.path and
    sys.modules lose what the example added: a job puts the folder it runs in on the path
    and imports the example's package from there."""
    shutil.copytree(EXAMPLE.parent / name, folder, ignore=shutil.ignore_patterns("example-out", "__pycache__", "mlruns"))
    path, modules = list(sys.path), set(sys.modules)
    try:
        yield folder
    finally:
        sys.path[:] = path
        for module in set(sys.modules) - modules:
            if (package and module.split(".")[0] == package) or module == f"{name}_notebook":
                del sys.modules[module]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    with _checkout("own_model", tmp_path_factory.mktemp("example") / "own_model", "mynets") as folder:
        yield folder


def _notebook(folder: Path, name: str = "own_model"):
    spec = importlib.util.spec_from_file_location(f"{name}_notebook", folder / "notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(out: dict, tracking_uri: str, rows: int) -> None:
    from mlflow.tracking import MlflowClient

    trained, scored = out["trained"], out["scored"]
    assert {"val_loss", "val_accuracy", "val_top2"} <= trained.metrics.keys(), trained.metrics
    mlflow = MlflowClient(tracking_uri)
    run = mlflow.get_run(trained.run_id)
    assert run.info.status == "FINISHED" and run.data.params["model"] == "mynets.nets:build"
    assert "val_top2" in run.data.metrics and 0.0 <= run.data.metrics["val_top2"] <= 1.0
    version = mlflow.get_model_version(trained.model_name, trained.model_version)
    assert version.run_id == trained.run_id
    assert trained.model_uri == f"models:/{trained.model_name}/{trained.model_version}"

    test_rows = out["prepared"].manifest.splits["test"].rows
    assert scored.rows == test_rows > 0 and scored.model_version == trained.model_version
    import pyarrow.parquet as pq

    assert pq.read_table(scored.version_dir).num_rows == test_rows

    pred = out["predictions"]
    assert len(pred) == rows and pred["prediction"].notna().all()
    assert set(pred["prediction"].unique()) <= {0, 1, 2}
    assert out["estimator_model_uri"].startswith(f"models:/{trained.model_name}-estimator/")


@pytest.mark.slow
def test_example_on_spark(example, spark, tracking_uri, tmp_path, monkeypatch):
    monkeypatch.chdir(example)  # `mynets` is found from the folder the user runs in
    nb = _notebook(example)
    # The session's MLflow store: one of its own would stay MLflow's global URI for later tests.
    out = nb.on_spark(spark, tmp_path, tracking_uri=tracking_uri, name="example-spark")
    assert out["trained"].launcher == "spark" and out["scored"].engine == "spark"
    assert out["prepared"].engine == "spark"
    _check(out, tracking_uri, rows=len(nb.frame()))
    assert "probability" in out["predictions"].columns
    assert not (example / "example-out").exists()  # everything went under the workdir given


@pytest.mark.slow
def test_example_on_dask(example, dask_client, tracking_uri, tmp_path, monkeypatch):
    monkeypatch.chdir(example)
    nb = _notebook(example)
    out = nb.on_dask(dask_client, tmp_path, tracking_uri=tracking_uri, name="example-dask")
    assert out["trained"].launcher == "dask" and out["scored"].engine == "dask"
    assert out["prepared"].engine == "dask"
    _check(out, tracking_uri, rows=len(nb.frame(seed=1)))
    pred = out["predictions"]
    assert out["estimator_accuracy"] == pytest.approx((pred["prediction"] == pred["label"]).mean())
    assert dask_client.status == "running"


@pytest.mark.slow
def test_example_job_through_the_cli(example, spark, tracking_uri, tmp_path):
    """`shardline run job.toml` from the example's folder, its outputs moved into tmp_path.

    The CLI in this process (`shardline_here`), on the session's SparkSession, which the
    command takes as the active one (a subprocess would start a JVM of its own, and fresh
    Python workers, for the same job.toml the notebook test already ran through the API)."""
    sets = {
        "pipelines.source.path": tmp_path / "raw", "pipelines.dataset_dir": tmp_path / "dataset",
        "training.checkpoint_dir": tmp_path / "checkpoints", "serving.output_dir": tmp_path / "scores",
        "tracking.tracking_uri": tracking_uri,
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = shardline_here("run", "job.toml", *args, "--set", "training.epochs=1", "--json", cwd=example)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["train"]["model_uri"] == "models:/own-model/1" and result["train"]["launcher"] == "spark"
    assert {"val_loss", "val_top2"} <= result["train"]["metrics"].keys()
    assert result["score"]["rows"] == result["prepare"]["splits"]["test"]["rows"] > 0
    assert not (example / "example-out").exists()  # every output went where --set put it

    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri).get_run(result["train"]["run_id"])
    assert run.data.params["model"] == "mynets.nets:build" and "val_top2" in run.data.metrics


@pytest.mark.slow
@pytest.mark.parametrize("name, package, strategy, launcher, scorer, figure", [
    ("images", "imgnets", "fsdp", "dask", "spark", "val_accuracy"),
    ("language_model", None, "pipeline", "spark", "dask", "val_perplexity"),
])
def test_typed_examples_prepare_on_both_engines_train_register_and_score(
    name, package, strategy, launcher, scorer, figure, spark, dask_client, tracking_uri, tmp_path, monkeypatch
):
    """examples/images (generated PNGs in class folders, the example's own CNN) and
    examples/language_model (generated token sequences, the built-in decoder): prepared on
    Spark and on Dask into the same shards, trained with a non-DDP strategy, registered and
    scored, from a copy of the example's folder as a user's checkout. Small and one epoch."""
    from mlflow.tracking import MlflowClient

    with _checkout(name, tmp_path / name, package) as folder:
        monkeypatch.chdir(folder)  # the model's package is found from the folder the job runs in
        nb = _notebook(folder, name)
        small = {"per_class": 24} if name == "images" else {"rows": 160}
        out = nb.run(spark, dask_client, tmp_path / "work", tracking_uri=tracking_uri, name=f"example-{name}",
                     epochs=1, **small)
    assert out["same_shards"] and {p.engine for p in out["prepared"].values()} == {"spark", "dask"}
    trained, scored = out["trained"], out["scored"]
    assert trained.model_uri == f"models:/example-{name}/1" and trained.launcher == launcher
    run = MlflowClient(tracking_uri).get_run(trained.run_id)
    assert run.data.params["strategy"] == strategy and figure in run.data.metrics, run.data
    test_rows = out["prepared"]["dask"].manifest.splits["test"].rows
    assert scored.engine == scorer and scored.rows == test_rows > 0 and scored.model_version == "1"
    assert not (folder / "example-out").exists()  # everything went under the work folder given


@pytest.mark.slow
@pytest.mark.parametrize("example", ["gan", "towers"])
def test_own_loop_examples_killed_and_resumed_on_every_launcher_then_scored(
    example, spark, dask_client, tracking_uri, tmp_path, monkeypatch, capfd
):
    """examples/own_loop (#52 item 7), from a copy of its folder as a user's checkout: the
    GAN (two models, two optimizers, alternating steps) or the two towers (two forward passes,
    an in-batch loss) prepared on Spark, trained once whole on the local launcher, then on the
    local launcher, the session's Spark and its Dask with rank 1 SIGKILLed after the first
    checkpoint: each relaunched run ends on the whole run's weights (torch.equal), its
    restart counted in its one MLflow run. The registered generator is scored with
    `shardline score` on a table of latent vectors, the item tower on the test split
    (an embedding per key). Full tier (~40 s each, idle): four small trainings and a score."""
    import threading

    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from mlflow.tracking import MlflowClient

    from .test_checkpoints import LOST, _kill_rank_after_first_checkpoint

    with _checkout("own_loop", tmp_path / "own_loop", "ownloops") as folder:
        monkeypatch.chdir(folder)  # `ownloops` is found from the folder the job runs in
        nb = _notebook(folder, "own_loop")
        work, name = tmp_path / "work", f"own-loop-{example}"
        prepared = nb.prepare(example, work, spark=spark, small=True, tracking_uri=tracking_uri)
        whole = nb.train(example, work, small=True, tracking_uri=tracking_uri, name=name)
        for launcher, handles in (("local", {}), ("spark", {"spark": spark}), ("dask", {"client": dask_client})):
            ckpt = work / f"killed-{launcher}"
            done, killed = threading.Event(), []
            watcher = threading.Thread(target=_kill_rank_after_first_checkpoint, args=(ckpt, 1, done, killed))
            capfd.readouterr()
            watcher.start()
            try:
                got = nb.train(example, work, small=True, tracking_uri=tracking_uri, name=name, sets={
                    "training.checkpoint_dir": str(ckpt), "training.max_restarts": 1}, **handles)
            finally:
                done.set()
                watcher.join()
            assert killed and got.launcher == launcher, (launcher, killed)
            restarts = [ln for ln in capfd.readouterr().err.splitlines() if "restarting from" in ln]
            assert len(restarts) == 1 and re.search(LOST[launcher].format(pid=killed[0]), restarts[0]), restarts
            assert got.weights.keys() == whole.weights.keys()
            for k, v in whole.weights.items():
                assert torch.equal(got.weights[k], v), (launcher, k)
            assert MlflowClient(tracking_uri).get_run(got.run_id).data.metrics["restarts"] == 1.0

        out = work / "scored"
        args = ["--model", whole.model_uri, "--output", str(out), "--set", f"tracking.tracking_uri={tracking_uri}",
                "--set", f"pipelines.dataset_dir={prepared.dataset_dir}"]
        if example == "gan":  # the generator's own inputs: noise and a digit per key
            args += ["--input", str(nb._make_data().write_latents(work / "latents.parquet", rows=12))]
        proc = shardline_here("score", f"{example}.toml", *args, "--json", cwd=folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pq.read_table(out).sort_by("key")
    values = np.stack(table.column("output").to_pylist())
    if example == "gan":  # a [1, 16, 16] image a row, in the generator's tanh range
        assert table.num_rows == 12 and values.shape == (12, 256) and np.abs(values).max() <= 1.0
    else:  # a unit-length item embedding per key of the test split
        assert table.num_rows == prepared.manifest.splits["test"].rows > 0 and values.shape[1] == 16
        np.testing.assert_allclose(np.linalg.norm(values, axis=1), 1.0, rtol=1e-5)
