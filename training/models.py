"""Models by name. A model never knows how it is parallelised."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipelines.errors import ConfigError
from pipelines.manifest import ShardManifest
from pipelines.transform import continuous_width

from .config import TrainingConfig


class TabularMLP(nn.Module):
    """MLP over one float tensor: standardised numerics, then categorical indices.

    One input tensor (not a tuple) keeps the MLflow signature and pyfunc simple.
    """

    def __init__(
        self,
        n_numeric: int,
        cardinalities: list[int],
        hidden: list[int],
        n_classes: int,
        embedding_dim: int = 8,
    ):
        super().__init__()
        self.n_numeric = n_numeric
        # +1: index 0 is the unknown bucket.
        self.embeddings = nn.ModuleList(nn.Embedding(c + 1, embedding_dim) for c in cardinalities)
        width = n_numeric + embedding_dim * len(cardinalities)
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, n_classes))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [x[:, : self.n_numeric]]
        for i, emb in enumerate(self.embeddings):
            idx = x[:, self.n_numeric + i].long().clamp(0, emb.num_embeddings - 1)
            parts.append(emb(idx))
        return self.mlp(torch.cat(parts, dim=1))


def _mlp(manifest: ShardManifest, cfg: TrainingConfig) -> nn.Module:
    stats = manifest.statistics
    spec = manifest.feature_spec
    return TabularMLP(
        n_numeric=continuous_width(spec),
        cardinalities=[stats.cardinality[c] for c in spec.categorical],
        hidden=cfg.hidden,
        n_classes=stats.num_classes,
        embedding_dim=cfg.embedding_dim,
    )


MODELS: dict[str, Callable[[ShardManifest, TrainingConfig], nn.Module]] = {"mlp": _mlp}


def build_model(manifest: ShardManifest, cfg: TrainingConfig) -> nn.Module:
    """Build `cfg.model` for the dataset's shape, seeded so every rank starts equal."""
    if cfg.model not in MODELS:
        raise ConfigError(
            f"training.model: unknown model '{cfg.model}' (valid: {', '.join(sorted(MODELS))})"
        )
    torch.manual_seed(cfg.seed)
    return MODELS[cfg.model](manifest, cfg)
