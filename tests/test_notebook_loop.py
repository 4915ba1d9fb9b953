"""The notebook loop (#45 item 5): train, edit the model's code, train again in the same
Python process. The second job must check, train and register the new code on the driver
and on every rank: the job's code snapshot (pipelines.code_travel.snapshot, a zip named by
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


def train_edit_train(tmp_path, prepared, tracking_uri, launcher, **engines):
    from shardline.training.raw_model import load_torch_model

    write_nets(tmp_path / "code", 16)
    sys.path.insert(0, str(tmp_path / "code"))
    try:
        cfg = overrides(tmp_path, prepared, tracking_uri, launcher, f"notebook-{launcher}")
        first = shardline.train(None, cfg, **engines)
        write_nets(tmp_path / "code", 32)  # the user edits the model in their editor
        second = shardline.train(None, {**cfg, "training.checkpoint_dir": str(tmp_path / f"ckpt2-{launcher}")},
                                 **engines)
        assert first_weight(first)[0] == 16 and first_weight(second)[0] == 32
        assert int(second.model_version) == int(first.model_version) + 1
        # The registered model is the new code's: its module rebuilds with width 32.
        assert load_torch_model(second.model_uri)[0].weight.shape[0] == 32
    finally:
        sys.path.remove(str(tmp_path / "code"))
        for m in [m for m in sys.modules if m.split(".")[0] == "nbnets"]:
            del sys.modules[m]
    return first, second


def test_edit_and_train_again_on_the_local_launcher(tmp_path, prepared, tracking_uri):
    train_edit_train(tmp_path, prepared, tracking_uri, "local")


@pytest.mark.slow
def test_edit_and_train_again_on_a_spark_session_given(tmp_path, prepared, tracking_uri, spark):
    train_edit_train(tmp_path, prepared, tracking_uri, "spark", spark=spark)


@pytest.mark.slow
def test_edit_and_train_again_on_a_dask_client_given(tmp_path, prepared, tracking_uri, dask_client):
    train_edit_train(tmp_path, prepared, tracking_uri, "dask", client=dask_client)
