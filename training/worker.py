"""The one worker function every launcher calls, once per rank, inside the process group."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipelines.manifest import ShardManifest, load_manifest

from . import checkpoints
from .config import TrainingConfig
from .loader import ShardLoader
from .models import apply_activation_checkpointing, build_model
from .strategies import get_strategy
from .tracking import MetricsReporter


_SHOWN = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "samples_per_s")


@dataclass
class TrainJob:
    """Everything a rank needs; pickled to Spark tasks, Dask workers and processes."""

    cfg: TrainingConfig
    dataset_dir: str
    tracking_uri: str | None = None
    run_id: str | None = None
    fingerprint: dict | None = None
    resume_from: str | None = None  # a checkpoint path; None starts from scratch
    # Rank 0 calls it after each epoch with (epoch, metrics); True stops every rank
    # after that epoch (a sweep's pruner). Must pickle, like the rest of the job.
    epoch_hook: Callable[[int, dict[str, float]], bool] | None = None


def train_rank(rank: int, world_size: int, job: TrainJob) -> dict | None:
    """The rank function of a training job (see training.launchers)."""
    cfg = job.cfg
    torch.set_num_threads(cfg.threads_per_rank)
    device = _device(rank)
    manifest = load_manifest(job.dataset_dir)
    local_batch = cfg.batch_size // world_size
    loader_settings = dict(
        remainder=cfg.remainder, shuffle_buffer_rows=cfg.shuffle_buffer_rows,
        workers=cfg.loader_workers_for(manifest.plan), prefetch=cfg.prefetch_depth,
        verify=cfg.verify_shards,
    )
    train = ShardLoader(
        manifest, job.dataset_dir, "train", rank, world_size, local_batch, cfg.seed, **loader_settings
    )
    val_shards = manifest.splits["val"].shards if "val" in manifest.splits else []
    val = (
        ShardLoader(
            manifest, job.dataset_dir, "val", rank, world_size, local_batch, cfg.seed, **loader_settings
        )
        if len(val_shards) >= world_size
        else None
    )

    model = trainable_model(manifest, cfg, device)
    strategy = get_strategy(cfg.strategy)
    wrapped = strategy.wrap(model, cfg)
    optimizer = make_optimizer(wrapped, cfg)
    scheduler = lr_scheduler(optimizer, cfg, cfg.epochs * train.steps_per_epoch())
    autocast = autocast_for(device, cfg)
    reporter = MetricsReporter(job.tracking_uri, job.run_id) if rank == 0 else None
    _announce(cfg.checkpoint_dir, rank)

    step = start_epoch = 0
    if job.resume_from:
        state = checkpoints.load(Path(job.resume_from), job.fingerprint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"][rank])
        step, start_epoch = state["global_step"], state["epoch"]
        # The loader's position is the same on every rank; rank 0's stands for all.
        train.load_state_dict(state["loader"])

    def checkpoint(epoch: int, step_in_epoch: int, artifact: bool) -> None:
        # Every rank's RNG state, so each resumes its own stream; rank 0 writes.
        rng = [torch.empty_like(torch.get_rng_state()) for _ in range(world_size)]
        dist.all_gather(rng, torch.get_rng_state())
        if rank != 0:
            return
        state = {
            "model": strategy.unwrap(wrapped).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "global_step": step,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "loader": train.state_dict(),
            "rng": rng,
            "fingerprint": job.fingerprint or {},
            "run_id": job.run_id or "",
        }
        path = checkpoints.save(cfg.checkpoint_dir, step, state, cfg.keep_checkpoints)
        if reporter:
            reporter.checkpoint(path, step, artifact)

    metrics: dict[str, float] = {}
    stopped_early = warned = False
    for epoch in range(start_epoch, cfg.epochs):
        wrapped.train()
        loss_sum = correct = seen = waited = stepping = 0.0
        start = time.perf_counter()
        # Resuming mid-epoch, the loader (its state loaded) yields exactly the rest.
        step_in_epoch = train.state_dict()["batches"] if train.state_dict()["epoch"] == epoch else 0
        batches = train.epoch(epoch)
        while True:
            t = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - t
            if batch is None:
                break
            x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            logits, loss = train_step(wrapped, optimizer, autocast, x, y)
            scheduler.step()
            # A step's time: waiting for its batch plus computing on it (not logging or checkpoints).
            stepping += time.perf_counter() - t
            step += 1
            step_in_epoch += 1
            loss_sum += loss.item() * len(y)
            correct += (logits.argmax(1) == y).sum().item()
            seen += len(y)
            if reporter and step % cfg.log_every_steps == 0:
                reporter.log({"train_loss_step": loss.item(), "lr": scheduler.get_last_lr()[0]}, step)
            if cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0:
                checkpoint(epoch, step_in_epoch, artifact=False)
        elapsed = time.perf_counter() - start

        # Per-rank figures go to rank 0 through one all-reduce of a [world, k] table.
        per_rank = torch.zeros(world_size, 3)
        per_rank[rank] = torch.tensor(
            [seen / elapsed, waited / max(stepping, 1e-9), train.epoch_stats()["samples_per_s"]]
        )
        totals = torch.tensor([loss_sum, correct, max(seen, 1.0)])
        dist.all_reduce(per_rank)
        dist.all_reduce(totals)
        metrics = {
            "train_loss": totals[0].item() / totals[2].item(),
            "train_accuracy": totals[1].item() / totals[2].item(),
            "samples_per_s": per_rank[:, 0].sum().item(),
            "data_wait_fraction": per_rank[:, 1].max().item(),
        }
        for r in range(world_size):
            metrics[f"rank{r}_samples_per_s"] = per_rank[r, 0].item()
            metrics[f"rank{r}_data_wait_fraction"] = per_rank[r, 1].item()
            metrics[f"rank{r}_loader_samples_per_s"] = per_rank[r, 2].item()
        if val is not None:
            metrics.update(_evaluate(model, val, device))
        if reporter:
            reporter.log(metrics, epoch)
            shown = ", ".join(f"{k} {metrics[k]:.4g}" for k in _SHOWN if k in metrics)
            print(f"[shardline] epoch {epoch + 1}/{cfg.epochs}: {shown}", file=sys.stderr, flush=True)
            if metrics["data_wait_fraction"] > cfg.data_wait_warning and not warned:
                # Once per job: later epochs' figures are in MLflow (rank*_data_wait_fraction).
                _warn_data_wait(epoch, cfg, per_rank[:, 1], loader_settings["workers"])
                warned = True
        checkpoint(epoch + 1, 0, artifact=True)
        if job.epoch_hook is not None and _stop_requested(job.epoch_hook, rank, epoch, metrics):
            # After the last epoch a stop changes nothing: the job simply completed.
            stopped_early = epoch + 1 < cfg.epochs
            break

    if rank != 0:
        return None
    buf = io.BytesIO()
    torch.save({k: v.cpu() for k, v in strategy.unwrap(wrapped).state_dict().items()}, buf)
    return {"state_dict": buf.getvalue(), "metrics": metrics, "stopped_early": stopped_early}


# The pieces of a step, shared with the bandwidth planner (training.plan) so that it
# measures the step training runs.


def trainable_model(manifest: ShardManifest, cfg: TrainingConfig, device: torch.device) -> torch.nn.Module:
    """The plain model on `device`, recomputing activations if configured; a strategy wraps it."""
    model = build_model(manifest, cfg).to(device)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    return model


def make_optimizer(model: torch.nn.Module, cfg: TrainingConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def autocast_for(device: torch.device, cfg: TrainingConfig) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def train_step(model, optimizer, autocast, x: torch.Tensor, y: torch.Tensor):
    """Forward, loss, backward, optimizer step; returns (logits, loss)."""
    with autocast:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return logits, loss


def _device(rank: int) -> torch.device:
    """The rank's device: the GPU its Spark task was given, else one GPU per local rank."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    given = os.environ.get("SHARDLINE_CUDA_DEVICE")
    index = int(given) if given else rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _warn_data_wait(epoch: int, cfg: TrainingConfig, wait: torch.Tensor, workers: int) -> None:
    worst = int(wait.argmax())
    print(
        f"[shardline] warning: epoch {epoch + 1}: rank {worst} waited for data "
        f"{wait[worst].item():.0%} of its step time (over {cfg.data_wait_warning:.0%}): raise "
        f"training.loader_workers (now {workers}) or training.prefetch_depth "
        f"(now {cfg.prefetch_depth}), or re-prepare with larger pipelines.layout.rows_per_row_group",
        file=sys.stderr, flush=True,
    )


def _stop_requested(hook, rank: int, epoch: int, metrics: dict[str, float]) -> bool:
    """Rank 0 asks the hook; every rank gets its answer, so all stop after the same epoch."""
    flag = torch.tensor([1.0 if rank == 0 and hook(epoch, metrics) else 0.0])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


@torch.no_grad()
def _evaluate(model, val: ShardLoader, device) -> dict[str, float]:
    model.eval()
    sums = torch.zeros(3)
    for x, y in val.all_batches(4096):
        logits = model(x.to(device))
        y = y.to(device)
        loss = F.cross_entropy(logits, y, reduction="sum").item()
        sums += torch.tensor([loss, (logits.argmax(1) == y).sum().item(), len(y)])
    dist.all_reduce(sums)
    return {"val_loss": (sums[0] / sums[2]).item(), "val_accuracy": (sums[1] / sums[2]).item()}


def _announce(checkpoint_dir: str, rank: int) -> None:
    """ranks/rank-N.json: which host and process is rank N (to watch or signal it)."""
    d = Path(checkpoint_dir) / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    info = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}
    tmp = d / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, d / f"rank-{rank}.json")


def lr_scheduler(optimizer, cfg: TrainingConfig, total_steps: int):
    """Linear warmup, then constant, cosine to 0, or x0.1 at each third of the run."""
    import math

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if cfg.lr_schedule == "step":
            return 0.1 ** min(int(progress * 3), 2)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
