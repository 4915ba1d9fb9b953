"""Models by name. A model never knows how it is parallelised."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

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
    n, cards, k = _shape(manifest)
    return TabularMLP(n, cards, cfg.hidden, k, embedding_dim=cfg.embedding_dim)


class FeatureCNN(nn.Module):
    """A small 1-D CNN over the feature vector (numerics, then embedded categories)."""

    def __init__(self, n_numeric: int, cardinalities: list[int], channels: int, n_classes: int):
        super().__init__()
        self.n_numeric = n_numeric
        self.embeddings = nn.ModuleList(nn.Embedding(c + 1, 1) for c in cardinalities)
        self.blocks = nn.Sequential(
            nn.Conv1d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool1d(4), nn.Flatten(),
        )
        self.head = nn.Linear(4 * channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [x[:, : self.n_numeric]]
        for i, emb in enumerate(self.embeddings):
            parts.append(emb(x[:, self.n_numeric + i].long().clamp(0, emb.num_embeddings - 1)))
        return self.head(self.blocks(torch.cat(parts, 1).unsqueeze(1)))


class FeatureTransformer(nn.Module):
    """Each feature is a token (value x learned vector + its position); a small encoder."""

    def __init__(
        self, n_numeric: int, cardinalities: list[int], d_model: int, heads: int, layers: int,
        n_classes: int,
    ):
        super().__init__()
        self.n_numeric = n_numeric
        self.value = nn.Parameter(torch.randn(n_numeric, d_model) * 0.02)
        self.position = nn.Parameter(torch.randn(n_numeric + len(cardinalities), d_model) * 0.02)
        self.embeddings = nn.ModuleList(nn.Embedding(c + 1, d_model) for c in cardinalities)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = [x[:, : self.n_numeric, None] * self.value]
        for i, emb in enumerate(self.embeddings):
            tokens.append(emb(x[:, self.n_numeric + i].long().clamp(0, emb.num_embeddings - 1))[:, None])
        h = self.encoder(torch.cat(tokens, 1) + self.position)
        return self.head(h.mean(1))


def _shape(manifest: ShardManifest) -> tuple[int, list[int], int]:
    spec, stats = manifest.feature_spec, manifest.statistics
    return continuous_width(spec), [stats.cardinality[c] for c in spec.categorical], stats.num_classes


def _cnn(manifest: ShardManifest, cfg: TrainingConfig) -> nn.Module:
    n, cards, k = _shape(manifest)
    return FeatureCNN(n, cards, channels=cfg.hidden[0], n_classes=k)


def _transformer(manifest: ShardManifest, cfg: TrainingConfig) -> nn.Module:
    if cfg.hidden[0] % cfg.heads:
        raise ConfigError(
            f"training.hidden[0] (d_model {cfg.hidden[0]}) must be divisible by training.heads {cfg.heads}"
        )
    n, cards, k = _shape(manifest)
    return FeatureTransformer(n, cards, d_model=cfg.hidden[0], heads=cfg.heads, layers=len(cfg.hidden), n_classes=k)


MODELS: dict[str, Callable[[ShardManifest, TrainingConfig], nn.Module]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "transformer": _transformer,
}


def check_model_name(name: str) -> None:
    if name not in MODELS:
        raise ConfigError(f"training.model: unknown model '{name}' (valid: {', '.join(sorted(MODELS))})")


def build_model(manifest: ShardManifest, cfg: TrainingConfig) -> nn.Module:
    """Build `cfg.model` for the dataset's shape, seeded so every rank starts equal."""
    check_model_name(cfg.model)
    torch.manual_seed(cfg.seed)
    return MODELS[cfg.model](manifest, cfg)


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute the activations of each top-level block in backward instead of storing them.

    The block's forward is replaced on the instance, so parameter names (and so
    checkpoints and the logged model) do not change. use_reentrant=False: the
    reentrant variant drops gradients when inputs do not require grad (FACTS.md).
    """
    from torch.utils.checkpoint import checkpoint

    for child in model.children():
        if isinstance(child, (nn.Sequential, nn.TransformerEncoder)):
            child.forward = partial(checkpoint, type(child).forward.__get__(child), use_reentrant=False)
    return model
