"""What shardline's own loop trains with: the model, the optimizer and the learning-rate
schedule of the settings; shared with the bandwidth planner (training.plan) and the
benchmarks, so that they measure the step training runs."""

from __future__ import annotations

import math

import torch

from shardline.pipelines.manifest import ShardManifest

from ..config import TrainingConfig
from ..models.builtin import apply_activation_checkpointing, build_model


def plain_model(manifest: ShardManifest, cfg: TrainingConfig) -> torch.nn.Module:
    """The seeded plain model on the default device (a strategies.base.ModelBuilder: a
    mesh that splits the model calls it under torch.device("meta") too). The strategy
    applies activation checkpointing, in its order (strategies.parallelize)."""
    return build_model(manifest, cfg)


def trainable_model(manifest: ShardManifest, cfg: TrainingConfig, device: torch.device) -> torch.nn.Module:
    """The plain model on `device`, recomputing activations if configured: one process's
    model as the bandwidth planner measures it (training.plan)."""
    model = plain_model(manifest, cfg).to(device)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    return model


def make_optimizer(params, cfg: TrainingConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def lr_factor(cfg: TrainingConfig, total_steps: int):
    """The learning rate's factor after `step` steps: linear warmup from 0, then
    constant, cosine to 0, or x0.1 at each third of the run."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if cfg.lr_schedule == "step":
            return 0.1 ** min(int(progress * 3), 2)
        return 1.0

    return factor


def data_wait_worth_warning(cfg: TrainingConfig, fraction: float, waited_s: float, steps: int) -> bool:
    """An epoch's wait is worth a warning when it is a large share of the step time AND long
    in absolute terms over enough steps: a short run's start-up wait (the first batch while
    the loader warms up) is a large share of a few steps, yet nothing a user should tune."""
    return (fraction > cfg.data_wait_warning and waited_s >= cfg.data_wait_warning_min_s
            and steps >= cfg.data_wait_warning_min_steps)
