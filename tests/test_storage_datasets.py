"""Datasets beside running jobs: versions kept for the retention, jobs pinned to the version they
started on, one prepare at a time, a scoring output held by one job (refused before any engine)."""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from shardline.engines import LocalEngine
from shardline.foundation import storage
from shardline.pipelines.config import PipelineConfig, RetentionConfig
from shardline.pipelines.manifest import load_manifest, prune, sequences
from shardline.pipelines.prepare import dataset_lease, prepare
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training

from .conftest import shardline_here
from .storage_helpers import hold_until_exists


def _pipeline(tmp: Path, rows: int, **retention) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "dataset_dir": str(tmp / "dataset"),
        "source": {"format": "synthetic", "path": str(tmp / f"raw-{rows}"), "synthetic": {"rows": rows, "partitions": 2}},
        "layout": {"world_size": 2},
        "retention": retention or {},
    })


def test_retention_keeps_the_newest_versions_and_the_recently_replaced(engines, tmp_path):
    versions = [prepare(engines["dask"], _pipeline(tmp_path, rows)) for rows in (600, 700, 800)]
    root = str(tmp_path / "dataset")
    # Default retention: 2 versions (the third prepare dropped nothing younger than 24 h).
    assert sequences(root) == [1, 2, 3]
    assert {p.name for p in Path(root).glob("v-*")} == {f"v-{m.version_id}" for m in versions}
    # A job pinned to the oldest still reads it.
    assert load_manifest(root, 1) == versions[0] and load_manifest(root) == versions[2]
    # Beyond both limits it goes, manifest first, then its shards.
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=25)
    assert prune(root, RetentionConfig(versions=2, hours=24), now=later) == [1]
    assert {p.name for p in Path(root).glob("v-*")} == {f"v-{m.version_id}" for m in versions[1:]}
    assert prune(root, RetentionConfig(versions=1, hours=0)) == [2]
    assert sorted(p.name for p in Path(root).iterdir()) == ["_manifests", f"v-{versions[2].version_id}"]
    with pytest.raises(Exception, match="dataset version 1 is gone"):
        load_manifest(root, 1)


@pytest.mark.slow
def test_reprepare_while_training_leaves_the_training_unaffected(engines, tmp_path):
    """A prepare commits a new version mid-training, then a rank is killed: the relaunched ranks
    read the version the job started on, and the job ends on the weights of an undisturbed run."""
    from mlflow.tracking import MlflowClient

    first = _pipeline(tmp_path, 2000)
    old = prepare(engines["dask"], first)
    cfg = dict(launcher="local", world_size=2, epochs=3, batch_size=128, hidden=[32],
               checkpoint_every_steps=5, keep_checkpoints=100, timeout_s=600)
    reference = run_training(
        TrainingConfig(**cfg, checkpoint_dir=str(tmp_path / "ckpt-ref")),
        TrackingConfig(experiment="reprepare-ref", registered_model="reprepare-ref"), first.dataset_dir, LocalEngine(),
    )

    ckpt, marker = tmp_path / "ckpt", tmp_path / "re-prepared"
    done, seen = threading.Event(), {}

    def reprepare_then_kill():
        rank1 = ckpt / "ranks" / "rank-1.json"
        deadline = time.monotonic() + 600
        while not (rank1.exists() and CheckpointStore(str(ckpt)).paths()) and not done.is_set():
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        # Rank 0 waits in the epoch hook until this commit: training is still running.
        seen["new"] = prepare(engines["dask"], _pipeline(tmp_path, 2600))
        marker.write_text("done")
        os.kill(json.loads(rank1.read_text())["pid"], signal.SIGKILL)
        seen["killed"] = True

    thread = threading.Thread(target=reprepare_then_kill)
    thread.start()
    try:
        result = run_training(
            TrainingConfig(**cfg, checkpoint_dir=str(ckpt)),
            TrackingConfig(experiment="reprepare", registered_model="reprepare"), first.dataset_dir, LocalEngine(),
            epoch_hook=functools.partial(hold_until_exists, str(marker)),
        )
    finally:
        done.set()
        marker.write_text("done")
        thread.join()
    assert seen.get("killed"), "the re-prepare did not happen during training"
    assert seen["new"].version_id != old.version_id
    assert load_manifest(first.dataset_dir) == seen["new"]  # the dataset moved on ...
    run = MlflowClient().get_run(result.run_id)
    assert run.data.metrics["restarts"] >= 1  # ... ranks started again after it ...
    assert run.data.params["dataset_version"] == old.version_id
    for k, v in reference.weights.items():  # ... and still trained on the old version
        assert torch.equal(v, result.weights[k]), k


def _config(tmp: Path) -> Path:
    path = tmp / "job.toml"
    path.write_text(
        f"[pipelines]\ndataset_dir = '{tmp / 'dataset'}'\n"
        f"[pipelines.source]\nformat = 'synthetic'\npath = '{tmp / 'raw'}'\n[pipelines.source.synthetic]\nrows = 500\n"
        f"[serving]\noutput_dir = '{tmp / 'scores'}'\n"
    )
    return path


def test_a_held_directory_is_refused_at_once_naming_its_holder(tmp_path):
    """prepare's dataset, held: refused before anything else. (A score takes its output's lease
    last, after the model and the input are known good: tests/bad_input_cases.py's "score into an
    output another job holds", tests/test_serving_promotion.py.)"""
    lease = dataset_lease(str(tmp_path / "dataset"))
    with lease:
        holder = lease.holder(lease.url)
        proc = shardline_here("prepare", str(_config(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 75, proc.stderr  # EX_TEMPFAIL: try again later
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"is in use by {holder.job} (host {holder.host}, pid {os.getpid()}, since {holder.since})" in errors[0]
    assert "Starting" not in proc.stderr  # no engine was started
    assert not storage.exists(lease.url)  # released; the refused job wrote nothing
