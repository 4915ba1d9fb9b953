"""A registered model that fails on every call, in real Spark tasks (imported by workers)."""

from __future__ import annotations

import torch


class AlwaysFails(torch.nn.Module):
    """Every attempt of every unit fails: the engine's retries run out."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        raise RuntimeError("injected: this model always fails")
