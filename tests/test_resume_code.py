"""A resume over changed code (#45 item 6), through the CLI in this process, local launcher:
refused in one line naming the files, before anything is written or logged, however small
the edit (an activation: the same shapes); allowed with --allow-changed code, and then the
run shows the change; a checkpoint from before the code was fingerprinted still resumes."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from shardline.foundation.code_travel import snapshot
from shardline.training.checkpoints.store import POINTER, CheckpointStore

from .conftest import shardline_here
from .defaults_helpers import small_dataset  # noqa: F401 (a fixture)
from .faults_helpers import error_lines

USERNETS = Path(__file__).parent / "usermodels" / "usernets"
EXPERIMENT = "resume-code"


def _bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _runs(tracking_uri: str) -> list:
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([exp.experiment_id]) if exp else []


@pytest.mark.slow  # four trainings of a user's model
def test_resume_over_changed_code_is_refused_naming_the_files(small_dataset, tracking_uri, tmp_path):  # noqa: F811
    project = tmp_path / "project"
    shutil.copytree(USERNETS, project / "usernets")  # the user's package, theirs to edit
    (project / "job.toml").write_text(
        f"[pipelines]\ndataset_dir = '{small_dataset.dataset_dir}'\n"
        f"[tracking]\nexperiment = '{EXPERIMENT}'\nregistered_model = '{EXPERIMENT}'\n"
        "[training]\nlauncher = 'local'\nworld_size = 1\nbatch_size = 64\nepochs = 1\n"
        "model = 'usernets.nets:build'\n"
    )

    def train(*extra: str):
        return shardline_here("train", str(project / "job.toml"), *extra, cwd=project,
                              env={"MLFLOW_TRACKING_URI": tracking_uri})

    r = train()
    assert r.returncode == 0, r.stderr[-3000:]
    (folder,) = (project / "shardline-data" / "checkpoints" / EXPERIMENT).iterdir()  # the job's own
    (first,) = _runs(tracking_uri)
    assert first.data.params["code_digest"] == snapshot([str(project / "usernets")]).digest

    # An edit that keeps every shape (another activation), and a file added beside it.
    nets = project / "usernets" / "nets.py"
    nets.write_text(nets.read_text().replace("return torch.relu(self.linear(", "return torch.tanh(self.linear("))
    (project / "usernets" / "extra.py").write_text("EXTRA = 1\n")
    before, runs = _bytes(folder), len(_runs(tracking_uri))
    r = train("--set", "training.epochs=2", "--resume")
    assert r.returncode == 2, r.stderr[-3000:]
    assert error_lines(r.stderr) == [
        f"error: {folder}: the code changed since the checkpoint: usernets/extra.py added, usernets/nets.py "
        "changed; to resume with it: --allow-changed code"
    ], r.stderr[-3000:]
    assert _bytes(folder) == before  # nothing written, nothing lost
    assert len(_runs(tracking_uri)) == runs  # nothing logged

    # Allowed: it resumes (the same folder: the code is not in its name) on the new code, and says so.
    r = train("--set", "training.epochs=2", "--resume", "--allow-changed", "code,epochs")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "code changed: usernets/extra.py added, usernets/nets.py changed" in r.stderr, r.stderr[-3000:]
    (run,) = _runs(tracking_uri)  # the checkpoint's run, continued
    edited = snapshot([str(project / "usernets")])
    tags, params = run.data.tags, run.data.params
    assert tags["shardline.resume_changed.code_files"] == "usernets/extra.py added, usernets/nets.py changed"
    assert tags["shardline.resume_changed.code"].split(" -> ")[1].startswith(edited.digest)
    assert [v for k, v in params.items() if k.startswith("code.from_step_")] == [edited.digest]
    pointer = json.loads((folder / POINTER).read_text())
    assert pointer["fingerprint"]["code"] == edited.digest and pointer["code_files"] == edited.files

    # A checkpoint written before the code was fingerprinted: resumed, said once.
    store = CheckpointStore(folder)
    head = store.latest()
    state = torch.load(head, weights_only=True)
    del state["fingerprint"]["code"], state["code_files"]
    buf = io.BytesIO()
    torch.save(state, buf)
    Path(head).write_bytes(buf.getvalue())
    (folder / POINTER).write_text(json.dumps({"name": Path(head).name, "step": state["global_step"]}))
    r = train("--set", "training.epochs=3", "--resume", "--allow-changed", "epochs")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("this job's code cannot be compared with the one that wrote it") == 1, r.stderr[-3000:]
