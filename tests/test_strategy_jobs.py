"""Every strategy as a user runs it: a tracked job whose registered model scores unchanged,
checkpoints that resume exactly, each launcher, and bad settings refused up front."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from shardline.engines import LocalEngine
from shardline.pipelines.manifest import load_manifest
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training
from shardline.engines.spark.launch import launch_spark_barrier
from shardline.training.models.builtin import build_model
from shardline.training.strategies import strategy_for

from .conftest import REPO, shardline_here
from .dist_helpers import train_steps

# Small versions of each strategy on this 2-core machine; world 3 for a server and 2 workers.
JOBS = {
    "ps": dict(strategy="ps", world_size=3, ps={"servers": 1}),
    "pipeline": dict(strategy="pipeline", world_size=2, pipeline={"micro_batches": 4, "schedule": "1f1b"}),
    "tensor": dict(strategy="tensor", world_size=2, model="transformer", hidden=[16, 16], heads=4),
    "fsdp": dict(strategy="fsdp", world_size=2),
}


def _cfg(tmp: Path, name: str, **kw) -> TrainingConfig:
    # ~37 steps an epoch on `prepared`: the first checkpoint (step 25) is mid-epoch 0, so the
    # resumed job crosses an epoch's end (asserted below). Not more often: each of fsdp's and
    # tensor's checkpoints is a sharded (DCP) save by every rank.
    base = dict(
        launcher="local", epochs=2, batch_size=128, hidden=[64, 32], timeout_s=60,
        checkpoint_dir=str(tmp / "ckpt"), checkpoint_every_steps=25, keep_checkpoints=100,
    )
    return TrainingConfig(**{**base, **JOBS[name], **kw})


@pytest.mark.parametrize("name", sorted(JOBS))
def test_strategy_job_resumes_exactly_and_its_model_scores(name, prepared, dask_client, tracking_uri, tmp_path,
                                                           capfd):
    from mlflow.tracking import MlflowClient

    from .serving_helpers import score

    cfg = _cfg(tmp_path / "a", name)
    tracking = TrackingConfig(experiment=f"strategy-{name}", registered_model=f"strategy-{name}")
    capfd.readouterr()  # only this job's own output below
    result = run_training(cfg, tracking, prepared.dataset_dir, LocalEngine())
    if name == "pipeline":  # it prints its schedule before training (a job of its own did, for this only)
        err = capfd.readouterr().err
        assert "stage 0" in err and "stage 1" in err and "(p-1)/(m+p-1)" in err, err
    assert result.metrics["val_accuracy"] > 0.5  # 3 classes: it learned
    run = MlflowClient(tracking_uri).get_run(result.run_id)
    # The strategy's own figures (tensor's and fsdp's collectives run inside torch: none).
    own = {"ps": "ps_push_ms", "pipeline": "pipeline_bubble_formula"}.get(name)
    assert own is None or own in run.data.metrics, sorted(run.data.metrics)
    # A training run does not time its pipeline (training.pipeline.timing): no measured bubble.
    assert "pipeline_bubble" not in run.data.metrics, sorted(run.data.metrics)
    # The ranks on the mesh, logged with the hosts they reported (training.rank_grid).
    grid = Path(MlflowClient(tracking_uri).download_artifacts(result.run_id, "mesh.txt", str(tmp_path))).read_text()
    rows = grid.splitlines()[2:]
    assert len(rows) == cfg.world_size and all(socket.gethostname() in row for row in rows), grid
    # MLflow's params name the settings as the config does, the mesh as resolved.
    shape = strategy_for(cfg).mesh
    assert shape is None or all(run.data.params[f"mesh.{d}"] == str(getattr(shape, d)) for d in ("tp", "pp", "dp_shard"))
    # Every tensor the job handed to training.collectives passed its device check (here the
    # CPU: a wrong device raises): the worker's metrics and evaluation, and the strategy's own.
    calls = result.collective_calls
    assert {device for _, device in calls} == {"cpu"}, calls
    assert calls[("all_reduce", "cpu")] >= 3 * cfg.epochs, calls  # metrics, totals, evaluation
    mine = {"ps": "reduce"}.get(name)
    assert mine is None or calls.get((mine, "cpu"), 0) > 0, calls

    # Resume from a mid-epoch checkpoint: the same final weights, bit for bit.
    paths = CheckpointStore(cfg.checkpoint_dir).paths()
    mid = Path(next(p for p in paths if torch.load(p, weights_only=True)["step_in_epoch"] != 0))
    assert torch.load(mid, weights_only=True)["epoch"] == 0  # the resumed job crosses an epoch's end
    resumed_cfg = _cfg(tmp_path / "b", name, resume=True)
    Path(resumed_cfg.checkpoint_dir).mkdir(parents=True)
    shutil.copy(mid, Path(resumed_cfg.checkpoint_dir) / mid.name)
    # Every strategy's ranks wrote their weights and optimizer state into a DCP directory;
    # the small file holds no weights: each rank's schedule, the epoch's metric sums so far
    # (a resumed epoch logs its figures over all its steps), the position, and its RNG.
    head = torch.load(mid, weights_only=True)
    assert "model" not in head and all({"loader", "sums"} <= set(r) for r in head["ranks"]), name
    assert len(head["rng"]) == len(head["ranks"]), name
    shutil.copytree(mid.parent / head["sharded"], Path(resumed_cfg.checkpoint_dir) / head["sharded"])
    resumed = run_training(resumed_cfg, tracking, prepared.dataset_dir, LocalEngine())
    assert resumed.weights.keys() == result.weights.keys()
    for k in result.weights:
        assert torch.equal(resumed.weights[k], result.weights[k]), k

    # The registered model is the plain model: `score` loads it as any other, and its
    # predictions are the trained weights' predictions.
    out = tmp_path / "scores"
    scored = score("dask", dask_client, resumed.model_uri, tracking_uri, prepared.dataset_dir, str(out))
    manifest = load_manifest(prepared.dataset_dir)
    assert scored.rows == manifest.splits["test"].rows
    table = pq.read_table(out).sort_by("key")
    plain = build_model(manifest, cfg)
    plain.load_state_dict(result.weights)
    plain.eval()
    test = pq.read_table([Path(prepared.dataset_dir) / s.path for s in manifest.splits["test"].shards]).sort_by("key")
    x = torch.from_numpy(
        test.column("features").combine_chunks().flatten().to_numpy().astype(np.float32).reshape(test.num_rows, -1)
    )
    with torch.no_grad():
        expected = plain(x).argmax(1).numpy()
    assert (table.column("prediction").to_numpy() == expected).all()


@pytest.mark.parametrize("name", sorted(JOBS))
def test_strategy_on_spark_barrier_tasks_matches_single_process(name, spark):
    # Spark's 2 task slots: a 1-worker, 1-server PS.
    args = {"strategy": name, "steps": 4, "batch": 32, "cfg": {"servers": 1} if name == "ps" else {}}
    if name == "tensor":
        args["model"] = "transformer"
    ranks = launch_spark_barrier(spark, train_steps, args, world_size=2, timeout_s=120)
    reference = train_steps(0, 1, args)
    for k in reference:
        torch.testing.assert_close(ranks[0][k], reference[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_strategy_on_dask_workers_matches_single_process(name, dask_client):
    from shardline.engines.dask.launch import launch_dask

    args = {"strategy": name, "steps": 4, "batch": 32, "cfg": {"servers": 1} if name == "ps" else {}}
    ranks = launch_dask(dask_client, train_steps, args, world_size=2, timeout_s=120)
    reference = train_steps(0, 1, args)
    for k in reference:
        torch.testing.assert_close(ranks[1][k], reference[k], atol=1e-5, rtol=1e-4, msg=k)


def test_async_ps_reaches_the_accuracy_of_synchronous_training(prepared, tmp_path):
    """Async updates are stale but bounded: the model lands in the synchronous run's band."""
    tracking = TrackingConfig(experiment="ps-async", registered_model="ps-async")
    common = dict(launcher="local", epochs=4, batch_size=128, hidden=[64, 32], timeout_s=60)
    sync = run_training(
        TrainingConfig(**common, world_size=2, checkpoint_dir=str(tmp_path / "ddp")), tracking,
        prepared.dataset_dir, LocalEngine(), register=False,
    )
    async_ = run_training(
        TrainingConfig(
            **common, world_size=3, strategy="ps", ps={"mode": "async", "staleness": 1},
            checkpoint_dir=str(tmp_path / "ps"),
        ),
        tracking, prepared.dataset_dir, LocalEngine(), register=False,
    )
    assert async_.metrics["val_accuracy"] >= sync.metrics["val_accuracy"] - 0.05, (async_.metrics, sync.metrics)
    # W=2 workers, ps.staleness k=1: at most (W-1)(2k+1) = 3 updates old (training/strategies/ps.py).
    assert 1 <= async_.metrics["ps_staleness_max"] <= 3


@pytest.mark.parametrize(
    "settings, message",
    [
        (["training.strategy=tensor", "training.world_size=2", "training.mesh.dp_replicate=2", "training.mesh.tp=2"],
         "training.mesh dp_replicate 2 x tp 2 = 4 must equal training.world_size 2"),
        (["training.strategy=tensor", "training.model=transformer", "training.hidden=[16]", "training.heads=4",
          "training.mesh.tp=3", "training.world_size=3", "training.batch_size=510"], "training.mesh.tp 3 must divide"),
        (["training.strategy=pipeline", "training.mesh.pp=4", "training.world_size=4", "training.hidden=[8]",
          "training.batch_size=512"], "more pipeline stages than"),
        (["training.strategy=pipeline", "training.world_size=3", "training.pipeline.micro_batches=2"],
         "training.pipeline.schedule 1f1b with training.mesh.pp 3, training.pipeline.micro_batches 2, 1 stage(s) per "
         "rank: Number of microbatches (2) must be greater than or equal to the number of stages (3)"),
        (["training.strategy=ps", "training.ps.servers=2"], "training.ps.servers 2 leaves no worker"),
        (["training.strategy=allgather"], "unknown strategy 'allgather' (valid: ddp, fsdp, pipeline, ps, tensor)"),
        (["training.strategy=tensor", 'training.tensor.plan={"1.linear"="colwise","9.linear"="rowwise"}'],
         "training.tensor.plan: module '9.linear' is not in training.model mlp (its Linear layers: 1.linear, "
         "2.linear, 3)"),
        (["training.strategy=fsdp", "training.world_size=4", "training.mesh.dp_replicate=2",
          "training.mesh.dp_shard=3"], "training.mesh dp_replicate 2 x dp_shard 3 = 6 must equal training.world_size 4"),
        (["training.strategy=fsdp", "training.world_size=4", "training.mesh.dp_shard=3"],
         "training.mesh dp_shard 3 = 3 must divide training.world_size 4"),
    ],
)
def test_cli_refuses_a_bad_mesh_before_any_process(prepared, tmp_path, settings, message):
    config = REPO / "jobs" / "configs" / "quickstart.toml"
    sets = [a for s in [*settings, f"pipelines.dataset_dir='{prepared.dataset_dir}'"] for a in ("--set", s)]
    proc = shardline_here("train", str(config), *sets, "--set", "training.launcher=local", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    # One error line (after at most the progress line of the stage it stopped), no traceback.
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2, proc.stderr
    assert not (tmp_path / "mlflow.db").exists()  # refused before the run was opened
