"""Training the same config again, as a user does: a changed epoch count trains anew in the
job's own checkpoint folder; a resume of a finished job is refused in one line; a resume
says where it resumes from, and an allowed change (--allow-changed lr) shows in MLflow.
Through the CLI in this process, local launcher, one rank."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from .conftest import REPO, shardline_here

QUICKSTART = str(REPO / "jobs" / "configs" / "quickstart.toml")


def _train(tmp_path, prepared, tracking_uri, *extra: str):
    args = ["train", QUICKSTART, "--set", f"pipelines.dataset_dir='{prepared.dataset_dir}'",
            "--launcher", "local", "--world-size", "1", "--set", "training.batch_size=256",
            "--set", "training.hidden=[16]", "--set", "tracking.experiment='rerun'",
            "--set", "tracking.registered_model='rerun'", *extra]
    return shardline_here(*args, cwd=tmp_path, env={"MLFLOW_TRACKING_URI": tracking_uri})


def _versions(tracking_uri: str) -> int:
    return len(MlflowClient(tracking_uri).search_model_versions("name='rerun'"))


def test_retrain_with_other_epochs_and_resume_rules(prepared, tracking_uri, tmp_path):
    # checkpoint_dir unset: both runs get the same folder of the job's own (epochs is not in its name).
    r = _train(tmp_path, prepared, tracking_uri, "--set", "training.epochs=2")
    assert r.returncode == 0, r.stderr
    r = _train(tmp_path, prepared, tracking_uri, "--set", "training.epochs=1")
    assert r.returncode == 0, r.stderr
    assert "starting over in this job's own checkpoint folder" in r.stderr, r.stderr
    assert "epochs 2" in r.stderr
    folders = list((tmp_path / "shardline-data" / "checkpoints" / "rerun").iterdir())
    assert len(folders) == 1, folders

    # Its last epoch is done: a resume would train 0 steps and register the same weights again.
    before = _versions(tracking_uri)
    r = _train(tmp_path, prepared, tracking_uri, "--set", "training.epochs=1", "--resume")
    assert r.returncode == 2, r.stderr  # a refused --resume (#53 item 12)
    err = r.stderr.strip()
    assert "\n" not in err and err.startswith("error: ") and "Traceback" not in err, err
    assert "the newest checkpoint ends the job (epoch 1 of training.epochs = 1 done)" in err, err
    assert "--set training.epochs=2 --allow-changed epochs" in err
    assert _versions(tracking_uri) == before

    # One more epoch with another lr, both allowed: said where it resumes from; the new lr logged.
    r = _train(tmp_path, prepared, tracking_uri, "--set", "training.epochs=2", "--set", "training.lr=0.0123",
               "--resume", "--allow-changed", "epochs,lr")
    assert r.returncode == 0, r.stderr
    assert f"resuming from {folders[0]}/ckpt-" in r.stderr, r.stderr
    assert "(step " in r.stderr and "epoch 1 of 2 done)" in r.stderr and "lr 0.003 -> 0.0123" in r.stderr
    assert _versions(tracking_uri) == before + 1
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("rerun")
    runs = [run for run in client.search_runs([exp.experiment_id])
            if any(k.startswith("lr.from_step_") for k in run.data.params)]
    assert len(runs) == 1
    params, tags = runs[0].data.params, runs[0].data.tags
    (key,) = [k for k in params if k.startswith("lr.from_step_")]
    assert params[key] == "0.0123" and params["epochs.from_step_" + key.rsplit("_", 1)[1]] == "2"
    assert tags["shardline.resume_changed.lr"].startswith("0.003 -> 0.0123 from step ")
