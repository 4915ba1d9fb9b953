"""Fully sharded data parallel (FSDP2 `fully_shard`, ZeRO-3), and HSDP on a 2-D mesh.

Every rank reads its own part of each global batch, as with DDP, but holds only
1/dp_shard of each parameter, of its gradient and of its optimizer state: before a
layer's forward (and again in its backward) its parameters are all-gathered from the
shard group, and after its backward its gradients are reduce-scattered, so each rank
steps the optimizer on its own shard. The mean over the shard group of equal local
batches' mean-loss gradients is the global batch's: single-process training on it.

HSDP (dp > 1): the mesh is dp replicas x dp_shard; each replica group shards as above
and the replicas all-reduce their gradient shards. FSDP2 takes the 2-D mesh as it is.

The model's FSDP units (training.model_plans.fsdp_units: its `fsdp_units()`, else each
child of a Sequential) are sharded each on its own (parameters gathered just before it
runs, freed after), then the root: at most one unit is whole at a time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from shardline.pipelines.errors import ConfigError

from .. import sharded_checkpoints
from ..config import TrainingConfig
from ..model_plans import fsdp_units
from ..task import loss_for
from .base import OptimizerFactory, autocast_for, mesh_for, train_step

# Full (unsharded) tensors on every rank: what a checkpoint's plain model and evaluation need.
_FULL = StateDictOptions(full_state_dict=True)


def shard_layers(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 on each of the model's units that has parameters, then on the whole model (the rest)."""
    for unit in fsdp_units(model):
        if any(True for _ in unit.parameters()):
            fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


class FullyShardedDataParallel:
    name = "fsdp"

    def check(self, cfg: TrainingConfig, model: nn.Module) -> None:
        mesh_for(cfg, "dp_shard")
        if cfg.batch_size % cfg.world_size:
            raise ConfigError(
                f"training.batch_size {cfg.batch_size} must be a multiple of "
                f"training.world_size {cfg.world_size} (fsdp: every rank reads its part)"
            )

    def data_world(self, cfg: TrainingConfig) -> int:
        mesh_for(cfg, "dp_shard")
        return cfg.world_size

    def setup(
        self, model: nn.Module, cfg: TrainingConfig, rank: int, world_size: int,
        device: torch.device, make_optimizer: OptimizerFactory,
    ) -> ShardedRank:
        mesh = mesh_for(cfg, "dp_shard")
        dm = mesh.device_mesh(device)
        # dp 1: plain FSDP over the shard dimension; dp > 1: HSDP (replicate x shard).
        shard_layers(model, dm if mesh.dp > 1 else dm["dp_shard"])
        return ShardedRank(model, cfg, device, make_optimizer, data_rank=rank, data_world=world_size,
                           reports=True)


class ShardedRank:
    """One rank of a model whose parameters are DTensors (FSDP2, DTensor tensor parallel
    or both): torch's state-dict API gives the plain model's tensors, and DCP its shards."""

    def __init__(self, model: nn.Module, cfg: TrainingConfig, device: torch.device,
                 make_optimizer: OptimizerFactory, *, data_rank: int, data_world: int, reports: bool):
        self.model = model
        self.optimizer = make_optimizer(model.parameters())
        self.autocast = autocast_for(device, cfg)
        self.loss = loss_for(cfg)
        self.data_rank, self.data_world, self.reports = data_rank, data_world, reports

    def step(self, x, y):
        self.model.train()
        out = train_step(self.model, self.optimizer, self.autocast, x, y, self.loss)
        return out if self.reports else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=_FULL)

    # Checkpoints: each rank writes and reads its own shards (training.sharded_checkpoints),
    # in place of Parallel's state_dict / load_state_dict.

    def save_sharded(self, directory: str) -> None:
        sharded_checkpoints.save(self.model, self.optimizer, directory)

    def load_sharded(self, directory: str) -> None:
        sharded_checkpoints.load(self.model, self.optimizer, directory)

    def epoch_metrics(self) -> dict[str, float]:
        # The collectives run inside torch (FSDP2, DTensor): no figures of our own.
        return {}

