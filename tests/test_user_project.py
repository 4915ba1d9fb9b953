"""A user's own project beside shardline (#36.6): its `training/` and `jobs/` packages are
its own, and shardline (installed under the one name `shardline`) neither shadows them nor
is shadowed by them, from Python and from the `shardline` command run in that folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .defaults_helpers import FEATURES, small_dataset  # noqa: F401 (a fixture)

MYMODEL = '''"""The user's model factory."""
from pathlib import Path

import torch.nn as nn

BUILT = Path(__file__).resolve().parents[1] / "built-by-mymodel.txt"


def build(inputs, width=3, classes=3, hidden=16, **kw):
    with open(BUILT, "a") as f:  # proof that this file's factory built the model
        f.write("built\\n")
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, classes))
'''


def _project(root: Path) -> Path:
    project = root / "myproject"
    (project / "training").mkdir(parents=True)
    (project / "training" / "__init__.py").write_text("")
    (project / "training" / "mymodel.py").write_text(MYMODEL)
    (project / "jobs").mkdir()
    (project / "jobs" / "__init__.py").write_text("WHOSE = 'the user'\n")
    return project


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}


def test_a_user_project_with_its_own_training_and_jobs(small_dataset, tmp_path):  # noqa: F811
    project = _project(tmp_path)
    env = _env()

    # Python in the project's folder: its packages are its own, shardline's are shardline's.
    code = ("import shardline, shardline.api, shardline.training.models, shardline.jobs.cli, training.mymodel, jobs\n"
            "print(training.mymodel.__file__); print(jobs.WHOSE)\n"
            "print(shardline.training.models.__file__); print(callable(shardline.train))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    mine, whose, theirs, api = proc.stdout.splitlines()
    assert Path(mine) == project / "training" / "mymodel.py"
    assert whose == "the user"
    assert project not in Path(theirs).parents and Path(theirs).name == "models.py"
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
