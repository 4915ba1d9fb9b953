"""Synchronous data parallel: every rank holds the model, gradients are all-reduced.

With a mean loss over each rank's equal local batch, DDP's averaged gradient is
the gradient of the mean loss over the global batch: single-process SGD on it.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel


class DataParallel:
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        return DistributedDataParallel(model)

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped.module
