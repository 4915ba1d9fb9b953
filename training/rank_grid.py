"""The job's ranks on its mesh, as `shardline plan` prints them and a run logs them to MLflow
(`MESH_GRID`): the strategy's places (strategies.grid) for the model's structure."""

from __future__ import annotations

import torch

from shardline.pipelines.manifest import ShardManifest

from .config import TrainingConfig
from .models.builtin import build_model
from .strategies import strategy_for

# The run's artifact holding the grid.
MESH_GRID = "mesh.txt"


def rank_grid(cfg: TrainingConfig, manifest: ShardManifest, hosts: list[str] | None = None,
              model: torch.nn.Module | None = None) -> str:
    """The grid of `cfg`'s ranks on `manifest`'s train split. model: the plain model (only
    its structure is read); unset, built on the meta device, which holds no memory. hosts:
    each rank's as far as they are known (the engine's before launch: Engine.hosts_before_launch;
    the ranks' own after: launchers.announced_hosts); None: not yet known."""
    if model is None:
        with torch.device("meta"):
            model = build_model(manifest, cfg)
    return strategy_for(cfg).grid(cfg, model, manifest, hosts)
