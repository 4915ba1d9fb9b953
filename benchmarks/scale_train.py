"""`bench scale`'s training: a fixed number of ddp steps over the whole dataset on the
engine's own launcher, then the trained model logged and registered as training does.

An epoch of 300M rows would take over an hour here, so the bench runs `steps` steps (the
forecast gives the epoch) with shardline's pieces: the model built from the manifest, the
ddp strategy's step, ShardLoader with the plan's loader workers, the Spark barrier or Dask
launcher (benchmarks.train_loops.timed_steps times them). Rank 0 returns the weights; the
driver logs them with training's own logging (training.models.registered), so scoring runs
the registered model the same way it runs any.
"""

from __future__ import annotations

import io


def scale_rank(rank: int, world_size: int, p: dict) -> dict:
    """One rank: `p["steps"]` steps (the first `p["warmup"]` untimed) of ddp on its share of
    the train split, epoch after epoch; rank 0 also returns the weights (safetensors-free
    torch.save bytes of a plain state dict)."""
    import torch

    from shardline.forecasting.sample_engine import reset_peak, rss_mb

    from .train_loops import ddp_rank, timed_steps

    # The rank's own memory: its process's high-water mark from here (a Dask worker or a Spark
    # Python worker may hold what earlier tasks left; that is its start, not the rank's growth).
    start_mb = reset_peak()
    parallel, batches = ddp_rank(rank, world_size, p)
    out = timed_steps(batches, parallel.step, p["warmup"], p["steps"] - p["warmup"], rank)
    mine = {"start_mb": start_mb, "peak_mb": rss_mb("VmHWM")}
    every: list = [None] * world_size
    torch.distributed.all_gather_object(every, mine)
    out["rank_start_mb"], out["rank_peak_mb"] = [r["start_mb"] for r in every], [r["peak_mb"] for r in every]
    full = parallel.export_state_dict()  # every rank takes part; rank 0 gets the weights
    if rank == 0:
        buf = io.BytesIO()
        torch.save({k: v.cpu() for k, v in full.items()}, buf)
        out["state_dict"] = buf.getvalue()
    return out


def register(result: dict, dataset_dir: str, training: dict, tracking_uri: str, name: str) -> str:
    """Rank 0's weights logged and registered under `name` in the bench's own MLflow store,
    as training.job does; the model URI."""
    import mlflow
    import torch

    from shardline.pipelines.manifest import load_manifest
    from shardline.training.config import TrainingConfig
    from shardline.training.models.builtin import build_model
    from shardline.training.models.registered import log_trained_model

    cfg = TrainingConfig.model_validate(training)
    manifest = load_manifest(dataset_dir)
    model = build_model(manifest, cfg)
    model.load_state_dict(torch.load(io.BytesIO(result["state_dict"]), weights_only=True))
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment("shardline-bench-scale")
    with mlflow.start_run():
        version = log_trained_model(model, manifest, cfg, name)
    return f"models:/{name}/{version}"
