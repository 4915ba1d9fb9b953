"""A small residual MLP, built by shardline from `training.model = "mynets.nets:build"`.

The protocol: shardline calls `build(inputs, **training.model_args)` with a
`shardline.training.models.inputs.ModelInputs` describing the prepared data. The module's
forward takes the `features` float32 tensor [batch, inputs.feature_width] — standardised
numerics (and vector elements) first, then one category index per categorical column
(0: unknown) — and returns [batch, inputs.num_classes] logits (or [batch, 1] values for a
regression). An nn.Sequential also runs under `training.strategy = "pipeline"`, which
splits it between ranks at its children.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Encode(nn.Module):
    """Numerics as they are; each categorical column through an embedding of its own."""

    def __init__(self, n_numeric: int, cardinalities: list[int], width: int, embed: int = 4):
        super().__init__()
        self.n_numeric = n_numeric
        # c + 1 rows: index 0 is the unknown bucket.
        self.embeddings = nn.ModuleList(nn.Embedding(c + 1, embed) for c in cardinalities)
        self.project = nn.Linear(n_numeric + embed * len(cardinalities), width)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        parts = [features[:, : self.n_numeric]]
        codes = features[:, self.n_numeric :].long()
        parts += [emb(codes[:, i]) for i, emb in enumerate(self.embeddings)]
        return torch.relu(self.project(torch.cat(parts, dim=1)))


class Residual(nn.Module):
    """x + MLP(LayerNorm(x))."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def build(inputs, width: int = 32, depth: int = 2) -> nn.Module:
    """Encode -> `depth` residual blocks -> a linear head of the task's output width."""
    out = inputs.num_classes if inputs.task == "classification" else 1
    return nn.Sequential(
        Encode(inputs.n_numeric, list(inputs.cardinalities), width),
        *(Residual(width) for _ in range(depth)),
        nn.Linear(width, out),
    )
