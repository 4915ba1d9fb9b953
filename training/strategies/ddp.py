"""Synchronous data parallel: every rank holds the model, gradients are all-reduced.

With a mean loss over each rank's equal local batch, DDP's averaged gradient is
the gradient of the mean loss over the global batch: single-process SGD on it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from shardline.foundation.errors import ConfigError

from ..config import TrainingConfig
from ..models.inputs import ModelInputs
from ..strategy_settings import DdpSettings
from ..task import loss_for
from .base import OptimizerFactory, Parallel, Strategy, autocast_for, mesh_for, train_step


class DataParallel(Strategy):
    name = "ddp"
    settings: DdpSettings

    def __init__(self, cfg: TrainingConfig):
        super().__init__(cfg.ddp, mesh_for(cfg, None), cfg.world_size)

    def check(self, cfg: TrainingConfig, model: nn.Module, inputs: ModelInputs | None = None) -> None:
        if cfg.batch_size % cfg.world_size:
            raise ConfigError(
                f"training.batch_size {cfg.batch_size} must be a multiple of "
                f"training.world_size {cfg.world_size}"
            )

    def prepare_module(self, model: nn.Module, cfg: TrainingConfig, world_size: int,
                       device: torch.device) -> nn.Module:
        return wrap(model.to(device), world_size, self.settings.grad_compression)

    def setup(
        self, model: nn.Module, cfg: TrainingConfig, rank: int, world_size: int,
        device: torch.device, make_optimizer: OptimizerFactory,
    ) -> DataParallelRank:
        return DataParallelRank(model, cfg, rank, world_size, device, make_optimizer,
                                self.settings.grad_compression)


def wrap(model: nn.Module, world_size: int, grad_compression: str = "none") -> nn.Module:
    """`model` in DistributedDataParallel with the job's gradient hooks; itself alone on one rank."""
    if world_size == 1:
        return model
    ddp = DistributedDataParallel(model)
    if grad_compression == "fp16":
        # Gradients travel as fp16 and are cast back: half the all-reduce bytes.
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return ddp


class DataParallelRank(Parallel):
    def __init__(self, model, cfg, rank, world_size, device, make_optimizer, grad_compression="none"):
        self.model = model
        self.ddp = wrap(model, world_size, grad_compression)
        self.optimizer = make_optimizer(self.ddp.parameters())
        self.rank = rank
        self.autocast = autocast_for(device, cfg)
        self.loss = loss_for(cfg)
        self.data_rank, self.data_world, self.reports = rank, world_size, True

    def step(self, x, y):
        self.ddp.train()
        return train_step(self.ddp, self.optimizer, self.autocast, x, y, self.loss)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        # Every replica holds the weights: rank 0 copies its own, nothing travels.
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()} if self.rank == 0 else {}

    # Checkpoints (Parallel.checkpoint_parts): every rank holds every tensor; DCP writes each
    # once, spread over the ranks, and a resume at any world size reads them all on every rank.
