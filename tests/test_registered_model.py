"""The registered model carries the user's model safely: safetensors weights and JSON that
rebuilds the module (never a pickle), the user's code inside it, loaded in a fresh process
that has the user's package only through the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from shardline.pipelines.manifest import load_manifest

from .serving_helpers import raw_table, trained_model

PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".joblib")


def _pickles(root: Path) -> list[str]:
    """Files under `root` that are pickles: by name, by a pickle's first bytes (protocol 2+
    starts with 0x80 and the protocol), or a zip (torch.save's format) holding one."""
    found = []
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        head = p.read_bytes()[:2]
        if p.suffix in PICKLE_SUFFIXES or "pickle" in p.name or (head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05"):
            found.append(str(p.relative_to(root)))
        elif head == b"PK" and zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                if any(n.endswith(".pkl") for n in z.namelist()):
                    found.append(str(p.relative_to(root)))
    return found


def test_the_registered_model_holds_safetensors_and_json_not_a_pickle(prepared, tracking_uri, tmp_path):
    import mlflow
    from safetensors import safe_open

    from shardline.training.models.registered import load_torch_model

    result = trained_model(prepared)
    mlflow.set_tracking_uri(tracking_uri)
    local = Path(mlflow.artifacts.download_artifacts(result.model_uri, dst_path=str(tmp_path / "model")))
    assert _pickles(local) == []
    assert (local / "code" / "shardline" / "training" / "models" / "files.py").is_file()

    weights = list(local.rglob("*.safetensors"))
    assert len(weights) == 1
    with safe_open(str(weights[0]), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert set(stored) == set(result.weights)
    for k, v in result.weights.items():
        assert (stored[k] == v).all(), k
    module = json.loads(next(local.rglob("module.json")).read_text())
    assert module["training"]["model"] == "mlp" and module["manifest"]["feature_spec"]

    loaded = load_torch_model(result.model_uri)
    assert set(loaded.state_dict()) == set(result.weights)
    for k, v in loaded.state_dict().items():
        assert (v == result.weights[k]).all(), k


def _shardline_here(rank, world_size, payload) -> str:
    import shardline

    return shardline.__file__


def test_a_model_leaves_no_copy_of_shardline_on_the_paths_of_the_processes_started_after(prepared, tracking_uri,
                                                                                         tmp_path):
    """MLflow puts a model's code folder, with the copy of shardline's engine packages it was
    logged with, first on sys.path and leaves it there: when `log_model` loads the model back to
    check its input example, and in `load_model` (a notebook's, a Dask worker's scoring task).
    A process started from the driver afterwards (multiprocessing, a rank server) imported
    shardline from that partial, older copy. Logging now puts the path back; a rank server
    started after a load leaves the model's folder off its path."""
    import mlflow
    import shardline

    from shardline.training.config import TrainingConfig
    from shardline.training.launchers import free_port
    from shardline.training.launchers.rank_call import RankCall, write_call
    from shardline.training.launchers.rank_process import RankServer
    from shardline.training.models.builtin import build_model
    from shardline.training.models.registered import log_raw_model

    manifest = load_manifest(prepared.dataset_dir)
    cfg = TrainingConfig(model="mlp", hidden=[4])
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment("model-path-test")
    before = list(sys.path)
    with mlflow.start_run():
        info = log_raw_model(build_model(manifest, cfg).eval(), manifest, cfg, None, pip_requirements=["torch"])
    # The folder the job runs from may be added (a user's project is importable: user_code).
    assert [p for p in sys.path if p not in before and p != os.getcwd()] == []

    mlflow.pyfunc.load_model(info.model_uri)
    ours = os.path.realpath(os.path.dirname(shardline.__file__))
    copies = [p for p in sys.path if os.path.isfile(os.path.join(p, "shardline", "__init__.py"))
              and os.path.realpath(os.path.join(p, "shardline")) != ours]
    assert copies, "load_model left no copy of shardline on sys.path: nothing here to check"
    server = RankServer()
    try:
        assert server.wait_ready(120)
        write_call(str(tmp_path / "call"), RankCall(_shardline_here, 0, 1, f"tcp://127.0.0.1:{free_port()}", None, 60),
                   None)
        rank = server.start(str(tmp_path / "call"), str(tmp_path / "result"))
        assert rank.wait(120) == 0, rank.outcome()
        said, where = rank.outcome()
        assert said == "ok" and os.path.realpath(os.path.dirname(where)) == ours, (where, copies)
    finally:
        server.stop()


def test_only_a_models_code_folder_is_left_off_a_ranks_path(tmp_path, monkeypatch):
    """Another checkout of shardline on the path stays (a Dask worker runs shardline from its
    client's zip, started in a user's folder that holds one and the user's own modules): the
    first rule here, any other copy left out, lost a worker's folder and the ranks could not
    import the tests' functions."""
    from shardline.training.launchers.rank_call import import_path

    model, checkout = tmp_path / "model", tmp_path / "checkout"
    for folder in (model / "code", checkout):
        (folder / "shardline").mkdir(parents=True)
        (folder / "shardline" / "__init__.py").write_text("")
    (model / "MLmodel").write_text("flavors: {}\n")
    monkeypatch.setattr(sys, "path", [str(model / "code"), str(checkout), *sys.path])
    path = import_path()
    assert str(model / "code") not in path and path[0] == str(checkout)


USER_FACTORY = '''
from torch import nn


def build(inputs, width, classes, hidden=16, **kw):
    # Any description of the inputs will do: its shape comes from model_args here.
    return nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, classes))
'''

# Run in a fresh Python whose sys.path lacks the user's package: found only in the model.
FRESH = '''
import importlib.util, json, sys
import numpy as np, pandas as pd, torch, mlflow
assert importlib.util.find_spec(sys.argv[1]) is None, "the user's package is importable without the model"
from shardline.training.models.registered import load_torch_model
x = torch.from_numpy(np.load(sys.argv[3]))
with torch.inference_mode():
    torch_out = load_torch_model(sys.argv[2])(x).numpy()
rows = pd.read_json(sys.argv[4], orient="records", lines=True)
pyfunc_out = mlflow.pyfunc.load_model(sys.argv[2]).predict(rows)
np.savez(sys.argv[5], torch=torch_out, pyfunc=pyfunc_out.filter(like="prob_").to_numpy())
'''


@pytest.mark.slow
@pytest.mark.parametrize("factory", [
    "builtin",
    "user",
])
def test_model_with_user_code_round_trips_in_a_fresh_process(factory, prepared, tracking_uri, tmp_path, monkeypatch):
    """Full tier only (`make test-all`, marker `slow`): the model is loaded in a Python process of its
    own."""
    import mlflow
    import torch

    from shardline.pipelines.transform import features_matrix
    from shardline.training.config import TrainingConfig
    from shardline.training.models.builtin import build_model
    from shardline.training.models.registered import log_raw_model, predict_raw

    pkg = f"shardline_user_{factory}_{os.getpid()}"  # a name no other test imports
    (tmp_path / "proj" / pkg).mkdir(parents=True)
    (tmp_path / "proj" / pkg / "__init__.py").write_text("")
    (tmp_path / "proj" / pkg / "factory.py").write_text(USER_FACTORY)
    manifest = load_manifest(prepared.dataset_dir)
    spec, stats = manifest.feature_spec, manifest.statistics
    rows = raw_table(prepared).slice(0, 8)
    x = features_matrix(rows, spec, stats, False)
    if factory == "user":
        cfg = TrainingConfig(model=f"{pkg}.factory:build",
                             model_args={"width": x.shape[1], "classes": stats.num_classes})
    else:  # a built-in model, the user's package shipped by code_paths
        cfg = TrainingConfig(model="mlp", hidden=[8], code_paths=[str(tmp_path / "proj" / pkg)])

    # As a user runs it: from their project folder, their package found there.
    monkeypatch.chdir(tmp_path / "proj")
    saved_path = list(sys.path)
    try:
        model = build_model(manifest, cfg).eval()
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_experiment("model-files-test")
        with mlflow.start_run():
            info = log_raw_model(model, manifest, cfg, None, pip_requirements=["torch"])
    finally:
        sys.path[:] = saved_path
        for name in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
            del sys.modules[name]
    local = Path(mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(tmp_path / "model")))
    assert (local / "code" / pkg / "factory.py").is_file()
    assert _pickles(local) == []

    with torch.inference_mode():
        want_torch = model(torch.from_numpy(x)).numpy()
    want_pyfunc = predict_raw(model, spec, stats, rows.to_pandas()).filter(like="prob_").to_numpy()
    np.save(tmp_path / "x.npy", x)
    rows.to_pandas().drop(columns=[spec.label]).to_json(tmp_path / "rows.jsonl", orient="records", lines=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", FRESH, pkg, info.model_uri, str(tmp_path / "x.npy"), str(tmp_path / "rows.jsonl"),
         str(tmp_path / "out.npz")],
        cwd=elsewhere, env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri},
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(got["torch"], want_torch)
    np.testing.assert_allclose(got["pyfunc"], want_pyfunc, rtol=1e-6)


def test_a_model_of_an_older_shardline_is_refused_in_one_line(tracking_uri, tmp_path):
    """One logged as a pickled module (no safetensors weights): refused, never unpickled."""
    import mlflow

    from shardline.foundation.errors import ShardlineError
    from shardline.training.models.registered import RawRowsModel, load_torch_model

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment("model-files-test")
    (tmp_path / "model.pt").write_bytes(b"a pickle would be here")
    with mlflow.start_run():
        info = mlflow.pyfunc.log_model(name="old", python_model=RawRowsModel(), pip_requirements=["torch"],
                                       artifacts={"model": str(tmp_path / "model.pt")})
    with pytest.raises(ShardlineError, match=r"holds no safetensors weights .*pickled module, which is never loaded"):
        load_torch_model(info.model_uri)
