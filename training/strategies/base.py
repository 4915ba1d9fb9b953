from __future__ import annotations

from typing import Protocol

from torch import nn

from ..config import TrainingConfig


class Strategy(Protocol):
    """Turns a plain model into its parallel form on an initialised process group."""

    name: str

    def wrap(self, model: nn.Module, cfg: TrainingConfig) -> nn.Module:
        """The module the training loop calls: forward, backward, optimizer.step."""
        ...

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The plain single-device model with the trained weights (for MLflow, scoring)."""
        ...
