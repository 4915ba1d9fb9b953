"""The notebook loop (#45 item 5): train, edit the model's code, train again in the same
Python process. The second job must check, train and register the new code on the driver
and on every rank: the job's code snapshot (foundation.code_travel.snapshot, a zip named by
its content) is what the ranks import, and the driver drops the modules it imported for an
older snapshot (training.user_code.refresh_driver_code).

Before, the driver kept the first job's module: its checks built the old model and, after
the whole training, loading the ranks' weights into it failed with "size mismatch" lines.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

import shardline

NETS = '''import torch
from torch import nn

WIDTH = {width}


def build(inputs):
    return nn.Sequential(nn.Linear(inputs.feature_width, WIDTH), nn.ReLU(), nn.Linear(WIDTH, inputs.output_width))
'''


def write_nets(folder: Path, width: int) -> Path:
    pkg = folder / "nbnets"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    nets = pkg / "nets.py"
    nets.write_text(NETS.format(width=width))
    # A stamp well after the first job's import: Python trusts a cached .pyc whose source has
    # the same size and modification second (16 -> 32 keeps the size), as an editor's save
    # minutes later would never be.
    stamp = time.time() + 10 * width
    os.utime(nets, (stamp, stamp))
    return pkg


def overrides(tmp_path: Path, prepared, tracking_uri: str, launcher: str, name: str) -> dict:
    return {
        "pipelines.dataset_dir": prepared.dataset_dir,
        "training.launcher": launcher, "training.world_size": 2, "training.epochs": 1,
        "training.batch_size": 256, "training.model": "nbnets.nets:build",
        "training.code_paths": [str(tmp_path / "code" / "nbnets")],
        "training.checkpoint_dir": str(tmp_path / f"ckpt-{launcher}"),
        "tracking.tracking_uri": tracking_uri, "tracking.experiment": "notebook-loop",
        "tracking.registered_model": name,
    }


def first_weight(result) -> tuple[int, ...]:
    return tuple(result.weights["0.weight"].shape)


def train_edit_train(tmp_path, prepared, tracking_uri, launcher, load_between: bool = False, **engines):
    """load_between: the first model is loaded with mlflow.pyfunc.load_model before the edit
    (to look at it), which puts that model's code folder, with its copy of nbnets, first on
    sys.path; the package is then found only on sys.path (no training.code_paths), as a
    user's project is."""
    from shardline.training.models.registered import load_torch_model

    write_nets(tmp_path / "code", 16)
    sys.path.insert(0, str(tmp_path / "code"))
    path_before = list(sys.path)
    try:
        cfg = overrides(tmp_path, prepared, tracking_uri, launcher, f"notebook-{launcher}")
        if load_between:
            cfg.pop("training.code_paths")
        first = shardline.train(None, cfg, **engines)
        if load_between:
            _pyfunc_load(first.model_uri, tracking_uri)
            assert (Path(sys.path[0]) / "nbnets" / "nets.py").is_file(), sys.path[0]  # the model's copy, first
        write_nets(tmp_path / "code", 32)  # the user edits the model in their editor
        second = shardline.train(None, {**cfg, "training.checkpoint_dir": str(tmp_path / f"ckpt2-{launcher}")},
                                 **engines)
        assert first_weight(first)[0] == 16 and first_weight(second)[0] == 32
        assert int(second.model_version) == int(first.model_version) + 1
        # The registered model is the new code's: its module rebuilds with width 32.
        assert load_torch_model(second.model_uri)[0].weight.shape[0] == 32
    finally:
        sys.path[:] = [p for p in path_before if p != str(tmp_path / "code")]
        for m in [m for m in sys.modules if m.split(".")[0] == "nbnets"]:
            del sys.modules[m]
    return first, second


def _pyfunc_load(model_uri: str, tracking_uri: str):
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    try:
        return mlflow.pyfunc.load_model(model_uri)
    finally:
        mlflow.set_tracking_uri(None)


def test_edit_and_train_again_on_the_local_launcher(tmp_path, prepared, tracking_uri):
    """With the first model loaded through MLflow in between (#53 item 1): before, the second
    job found nbnets in that model's code folder, shipped it and registered width 16 again."""
    train_edit_train(tmp_path, prepared, tracking_uri, "local", load_between=True)


LOOP = '''VERSION = {version}


def train(ctx):
    """Which version of this file ran, on every rank: the loop's own code travels with the job."""
    ctx.log({{"version": float(VERSION)}})
'''


def write_loop(folder: Path, version: int) -> None:
    pkg = folder / "nbloops"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "loop.py").write_text(LOOP.format(version=version))
    stamp = time.time() + 10 * version  # as write_nets: a later save than any cached .pyc
    os.utime(pkg / "loop.py", (stamp, stamp))


def test_edit_a_loop_and_train_again_on_the_local_launcher(tmp_path, prepared, tracking_uri):
    """The loop given as the function a notebook imported: it travels by its import path, so
    the second job runs the edited file, though the notebook passes the function it imported
    before the edit."""
    write_loop(tmp_path / "code", 1)
    sys.path.insert(0, str(tmp_path / "code"))
    try:
        from nbloops.loop import train as loop

        cfg = {**overrides(tmp_path, prepared, tracking_uri, "local", "notebook-loop"),
               "training.model": "mlp", "training.code_paths": [str(tmp_path / "code" / "nbloops")]}
        first = shardline.train(None, cfg, loop=loop)
        write_loop(tmp_path / "code", 2)  # the user edits the loop in their editor
        second = shardline.train(None, {**cfg, "training.checkpoint_dir": str(tmp_path / "ckpt-loop2")}, loop=loop)
    finally:
        sys.path.remove(str(tmp_path / "code"))
        for m in [m for m in sys.modules if m.split(".")[0] == "nbloops"]:
            del sys.modules[m]
    assert first.metrics["version"] == 1.0 and second.metrics["version"] == 2.0
    assert first.model_uri is None and second.model_uri is None  # the loop registers no model


@pytest.mark.slow
def test_edit_and_train_again_on_a_spark_session_given(tmp_path, prepared, tracking_uri, spark):
    train_edit_train(tmp_path, prepared, tracking_uri, "spark", spark=spark)


@pytest.mark.slow
def test_edit_and_train_again_on_a_dask_client_given(tmp_path, prepared, tracking_uri, dask_client):
    train_edit_train(tmp_path, prepared, tracking_uri, "dask", client=dask_client)


CONNECT_LOOP = """
import json, os, sys, time
from pyspark.sql import SparkSession
import shardline
url, code, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, code)
spark = SparkSession.builder.remote(url).getOrCreate()

def write(width):
    os.makedirs(code + "/nbnets", exist_ok=True)
    open(code + "/nbnets/__init__.py", "w").close()
    path = code + "/nbnets/nets.py"
    with open(path, "w") as f:
        f.write(sys.argv[4].format(width=width))
    stamp = time.time() + 10 * width
    os.utime(path, (stamp, stamp))

write(16)
first = shardline.train(None, overrides, spark=spark)
write(32)
second = shardline.train(None, {**overrides, "training.checkpoint_dir": overrides["training.checkpoint_dir"] + "2"},
                         spark=spark)
print(json.dumps([list(first.weights["0.weight"].shape), list(second.weights["0.weight"].shape),
                  first.model_version, second.model_version, type(spark).__module__]))
"""


@pytest.mark.slow
def test_edit_and_train_again_on_a_spark_connect_session(tmp_path, prepared, connect_server, connect_cli):
    """The same loop in a Spark Connect program (the session's Connect client process, as
    `python -c` would run it): the server's Python workers are reused between the jobs."""
    import json

    cfg = overrides(tmp_path, prepared, f"sqlite:///{tmp_path}/mlflow.db", "spark", "notebook-connect")
    proc = connect_cli.python(CONNECT_LOOP, connect_server.url, str(tmp_path / "code"), json.dumps(cfg), NETS,
                              cwd=tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:] + connect_server.log_tail()
    first, second, v1, v2, session = json.loads(proc.stdout.strip().splitlines()[-1])
    assert session.startswith("pyspark.sql.connect")
    assert first[0] == 16 and second[0] == 32 and int(v2) == int(v1) + 1


def _frame(rows: int = 600):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    return pd.DataFrame({"x0": x[:, 0], "x1": x[:, 1], "x2": x[:, 2], "label": (x[:, 0] > 0).astype(np.int64)})


def _estimator_config(tmp_path: Path, run: int) -> dict:
    return {
        "pipelines": {"dataset_dir": str(tmp_path / f"dataset{run}"), "source": {"path": str(tmp_path / "raw")}},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "registered_model": "notebook-estimator"},
        "training": {"world_size": 2, "batch_size": 64, "epochs": 1, "model": "nbnets.nets:build",
                     "code_paths": [str(tmp_path / "code" / "nbnets")], "checkpoint_dir": str(tmp_path / f"ckpt{run}")},
    }


def _estimator_loop(tmp_path: Path, fit) -> tuple:
    """fit(config) -> the fitted estimator's TrainResult, twice, the model edited between."""
    write_nets(tmp_path / "code", 16)
    sys.path.insert(0, str(tmp_path / "code"))
    try:
        first = fit(_estimator_config(tmp_path, 1))
        write_nets(tmp_path / "code", 32)
        second = fit(_estimator_config(tmp_path, 2))
    finally:
        sys.path.remove(str(tmp_path / "code"))
        for m in [m for m in sys.modules if m.split(".")[0] == "nbnets"]:
            del sys.modules[m]
    assert first_weight(first)[0] == 16 and first_weight(second)[0] == 32
    assert int(second.model_version) == int(first.model_version) + 1


@pytest.mark.slow
def test_edit_and_fit_again_with_the_spark_estimator(tmp_path, spark):
    from shardline.spark import ShardlineEstimator

    df = spark.createDataFrame(_frame())
    _estimator_loop(tmp_path, lambda cfg: ShardlineEstimator(cfg, label_col="label").fit(df).trained)


@pytest.mark.slow
def test_edit_and_fit_again_with_the_dask_estimator(tmp_path, dask_client):
    import dask.dataframe as dd

    from shardline.dask import ShardlineEstimator

    ddf = dd.from_pandas(_frame(), npartitions=2)
    _estimator_loop(tmp_path, lambda cfg: ShardlineEstimator(cfg, label_col="label", client=dask_client).fit(ddf).trained_)
