"""Synchronous data parallel: every rank holds the model, gradients are all-reduced.

With a mean loss over each rank's equal local batch, DDP's averaged gradient is
the gradient of the mean loss over the global batch: single-process SGD on it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ..config import TrainingConfig


class DataParallel:
    name = "ddp"

    def wrap(self, model: nn.Module, cfg: TrainingConfig) -> nn.Module:
        ddp = DistributedDataParallel(model)
        if cfg.grad_compression == "fp16":
            # Gradients travel as fp16 and are cast back: half the all-reduce bytes.
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped.module
