"""The training job: preflight errors before any process starts; a real tracked run."""

from __future__ import annotations

import pytest

from shardline.engines import DaskEngine, LocalEngine, SparkEngine
from shardline.foundation.errors import ConfigError, DataError, ShardlineError
from shardline.pipelines.manifest import load_manifest
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training
from shardline.training.tracking import dataset_digest

from .conftest import REPO, shardline_here


def test_local_launcher_trains_tracks_and_registers(prepared, tracking_uri, capfd):
    from mlflow.tracking import MlflowClient

    # Zero thresholds: any wait at all warns, and only once per job.
    cfg = TrainingConfig(launcher="local", world_size=2, epochs=2, batch_size=128, data_wait_warning=0.0,
                         data_wait_warning_min_s=0.0, data_wait_warning_min_steps=0)
    tracking = TrackingConfig(experiment="job-test", registered_model="job-test-model")
    result = run_training(cfg, tracking, prepared.dataset_dir, LocalEngine())
    client = MlflowClient(tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(result.run_id, "val_accuracy")] == [0, 1]
    assert {"rank0_samples_per_s", "rank1_samples_per_s", "data_wait_fraction",
            "rank0_loader_samples_per_s", "rank1_loader_samples_per_s"} <= set(run.data.metrics)
    assert 0 <= run.data.metrics["data_wait_fraction"] <= 1  # wait / step time
    assert run.data.metrics["rank1_loader_samples_per_s"] > 0
    assert result.metrics["val_accuracy"] > 0.6
    version = client.get_model_version("job-test-model", result.model_version)
    assert version.run_id == result.run_id
    # What a user sees in MLflow: a run named for what it is, the dataset as its input
    # (named for its directory and manifest, digested by content), a described, tagged version.
    manifest = load_manifest(prepared.dataset_dir)
    assert run.info.run_name == "train mlp ddp×2"
    [ds] = run.inputs.dataset_inputs
    assert ds.dataset.name == f"{prepared.dataset_dir}@{manifest.sequence}"  # the whole path: as the docs say
    assert ds.dataset.digest == dataset_digest(manifest) and len(ds.dataset.digest) == 16
    assert prepared.dataset_dir in ds.dataset.source
    assert [t.value for t in ds.tags if t.key == "mlflow.data.context"] == ["training"]
    assert version.tags["dataset_version"] == manifest.version_id
    assert version.tags["dataset_digest"] == ds.dataset.digest
    assert (version.tags["strategy"], version.tags["world_size"], version.tags["model"]) == ("ddp", "2", "mlp")
    assert float(version.tags["val_accuracy"]) == pytest.approx(result.metrics["val_accuracy"], rel=1e-5)
    assert version.description.startswith("mlp trained with ddp on 2 rank(s), 2 epoch(s), on dataset ")
    assert manifest.version_id in version.description
    warnings = [ln for ln in capfd.readouterr().err.splitlines() if "waited for data" in ln]
    assert len(warnings) == 1 and "epoch 1: rank " in warnings[0] and "(over 0%)" in warnings[0], warnings


@pytest.mark.parametrize(
    "update, error, message",
    [
        ({"model": "resnet"}, ConfigError, r"unknown model 'resnet' \(valid: cnn, decoder, mlp, transformer\)"),
        ({"strategy": "zero"}, ConfigError, r"unknown strategy 'zero'"),
        ({"world_size": 8, "batch_size": 64}, DataError, r"world size 8 is greater than the 2 shard"),
        ({"batch_size": 101}, ConfigError, r"batch_size 101 must be a multiple"),
    ],
)
def test_preflight_errors(prepared, update, error, message):
    cfg = TrainingConfig(launcher="local", **update)
    with pytest.raises(error, match=message):
        run_training(cfg, TrackingConfig(), prepared.dataset_dir, LocalEngine())


def test_unreachable_tracking_uri_fails_before_training(prepared):
    cfg = TrainingConfig(launcher="local")
    tracking = TrackingConfig(tracking_uri="http://127.0.0.1:9")
    with pytest.raises(ShardlineError, match=r"tracking.tracking_uri: MLflow at http://127.0.0.1:9 is not reachable"):
        run_training(cfg, tracking, prepared.dataset_dir, LocalEngine())


def test_no_train_split(tmp_path):
    with pytest.raises(DataError, match="no manifest"):
        run_training(TrainingConfig(launcher="local"), TrackingConfig(), str(tmp_path), LocalEngine())


def test_dask_launcher_trains_one_rank_per_worker(prepared, dask_client, tracking_uri):
    from mlflow.tracking import MlflowClient

    cfg = TrainingConfig(launcher="dask", world_size=2, epochs=1, batch_size=128)
    tracking = TrackingConfig(experiment="job-test-dask", registered_model="job-test-dask")
    result = run_training(cfg, tracking, prepared.dataset_dir, engine=DaskEngine(dask_client))
    run = MlflowClient(tracking_uri).get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["launcher"] == "dask"
    assert result.metrics["val_accuracy"] > 0.5


def test_more_ranks_than_dask_workers_is_refused(prepared, dask_client):
    cfg = TrainingConfig(launcher="dask", world_size=3, batch_size=129)
    with pytest.raises(ShardlineError, match=r"world_size 3 is greater than the 2 Dask workers"):
        run_training(cfg, TrackingConfig(), prepared.dataset_dir, engine=DaskEngine(dask_client))


def test_more_ranks_than_spark_slots_is_refused(prepared, spark):
    cfg = TrainingConfig(launcher="spark", world_size=3, batch_size=129)
    with pytest.raises(ShardlineError, match=r"world_size 3 is greater than the 2 task slots"):
        run_training(cfg, TrackingConfig(), prepared.dataset_dir, engine=SparkEngine(spark))


def test_every_switch_together_trains_the_transformer(prepared, tracking_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = TrainingConfig(
        launcher="local", world_size=2, epochs=2, batch_size=128, model="transformer",
        hidden=[16, 16], heads=4, precision="bf16", activation_checkpointing=True,
        ddp={"grad_compression": "fp16"}, lr_schedule="cosine", warmup_steps=20, log_every_steps=5,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    result = run_training(cfg, TrackingConfig(experiment="switches", registered_model="switches"), prepared.dataset_dir, LocalEngine())
    lrs = [m.value for m in MlflowClient(tracking_uri).get_metric_history(result.run_id, "lr")]
    assert lrs[0] < lrs[1] < lrs[2] and lrs[-1] < max(lrs) / 2  # warmup, then cosine decay
    assert result.metrics["val_accuracy"] > 0.45


def test_transformer_heads_must_divide_width(prepared):
    cfg = TrainingConfig(launcher="local", model="transformer", hidden=[30], heads=4)
    with pytest.raises(ConfigError, match=r"d_model 30\) must be divisible by training.heads 4"):
        run_training(cfg, TrackingConfig(), prepared.dataset_dir, LocalEngine())


@pytest.mark.parametrize(
    "command, setting, message",
    [
        ("train", "training.strategy=zero", "unknown strategy 'zero' (valid: ddp, fsdp, pipeline, ps, tensor)"),
        ("train", "training.model=resnet", "unknown model 'resnet' (valid: cnn, decoder, mlp, transformer)"),
        ("run", "training.strategy=zero", "unknown strategy 'zero' (valid: ddp, fsdp, pipeline, ps, tensor)"),
    ],
)
def test_cli_refuses_a_bad_name_before_spark_starts(prepared, tmp_path, command, setting, message):
    config = REPO / "jobs" / "configs" / "quickstart.toml"
    where = f"pipelines.dataset_dir='{prepared.dataset_dir}'"
    proc = shardline_here(command, str(config), "--set", setting, "--set", where, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr  # a setting at fault, as for any bad config
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Starting Spark" not in proc.stdout + proc.stderr  # no engine was started
    assert list(tmp_path.iterdir()) == []  # nothing written: no store, no data
