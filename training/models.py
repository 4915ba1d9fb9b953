"""Models by name. A model never knows how it is parallelised.

Every model is an `nn.Sequential` of layers, the input layer first: that order is
all a pipeline needs to cut it into stages, and the layers' own submodule names
(`linear`, `attn.q`, `ff1` ...) are all a tensor-parallel plan needs. Each model that
can be split by tensor parallelism has its plan here, beside it (as torchtitan keeps
one beside each model): module path -> "colwise" / "rowwise" (see `TP_PLANS`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from shardline.pipelines.errors import ConfigError
from shardline.pipelines.manifest import ShardManifest
from shardline.pipelines.transform import continuous_width

from .config import TrainingConfig


class FeatureInput(nn.Module):
    """The feature tensor (standardised numerics, then categorical indices) as numbers:
    numerics as they are, each category through its embedding; concatenated.

    One input tensor (not a tuple) keeps the MLflow signature and pyfunc simple.
    """

    def __init__(self, n_numeric: int, cardinalities: list[int], embedding_dim: int):
        super().__init__()
        self.n_numeric = n_numeric
        # +1: index 0 is the unknown bucket.
        self.embeddings = nn.ModuleList(nn.Embedding(c + 1, embedding_dim) for c in cardinalities)
        self.width = n_numeric + embedding_dim * len(cardinalities)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [x[:, : self.n_numeric]]
        for i, emb in enumerate(self.embeddings):
            parts.append(emb(x[:, self.n_numeric + i].long().clamp(0, emb.num_embeddings - 1)))
        return torch.cat(parts, dim=1)


class Dense(nn.Module):
    """Linear, then ReLU."""

    def __init__(self, width: int, out: int):
        super().__init__()
        self.linear = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


class TabularMLP(nn.Sequential):
    """Feature input, one Dense layer per hidden width, a linear head."""

    def __init__(
        self,
        n_numeric: int,
        cardinalities: list[int],
        hidden: list[int],
        n_classes: int,
        embedding_dim: int = 8,
    ):
        features = FeatureInput(n_numeric, cardinalities, embedding_dim)
        layers: list[nn.Module] = [features]
        width = features.width
        for h in hidden:
            layers.append(Dense(width, h))
            width = h
        layers.append(nn.Linear(width, n_classes))
        super().__init__(*layers)


class Channels(nn.Module):
    """[batch, features] -> [batch, 1, features]: the feature vector as a 1-channel signal."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1)


class ConvBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int):
        super().__init__()
        self.conv = nn.Conv1d(channels_in, channels_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class PoolHead(nn.Module):
    def __init__(self, channels: int, n_classes: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool1d(4)
        self.linear = nn.Linear(4 * channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.pool(x).flatten(1))


class FeatureCNN(nn.Sequential):
    """A small 1-D CNN over the feature vector (numerics, then embedded categories)."""

    def __init__(self, n_numeric: int, cardinalities: list[int], channels: int, n_classes: int):
        super().__init__(
            FeatureInput(n_numeric, cardinalities, 1),
            Channels(),
            ConvBlock(1, channels),
            ConvBlock(channels, channels),
            PoolHead(channels, n_classes),
        )


class Tokens(nn.Module):
    """Each feature is a token: a numeric's value x its learned vector, a category's
    embedding; plus a learned position per feature."""

    def __init__(self, n_numeric: int, cardinalities: list[int], d_model: int):
        super().__init__()
        self.n_numeric = n_numeric
        self.value = nn.Parameter(torch.randn(n_numeric, d_model) * 0.02)
        self.position = nn.Parameter(torch.randn(n_numeric + len(cardinalities), d_model) * 0.02)
        self.embeddings = nn.ModuleList(nn.Embedding(c + 1, d_model) for c in cardinalities)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = [x[:, : self.n_numeric, None] * self.value]
        for i, emb in enumerate(self.embeddings):
            tokens.append(emb(x[:, self.n_numeric + i].long().clamp(0, emb.num_embeddings - 1))[:, None])
        return torch.cat(tokens, 1) + self.position


class Attention(nn.Module):
    """Multi-head self-attention: q, k and v projections (head-major), then an output
    projection.

    The heads it computes are the projections' width / head_dim, not a stored count: a
    tensor-parallel plan that splits q, k and v by output features leaves each rank the
    whole heads of its slice, and this same code computes them (torchtitan's way; one
    fused [q | k | v] matrix split by rows would give a rank all of q and half of k).
    k has no bias: it would add q.b to every score of a query alike, which softmax
    ignores, so its gradient is exactly zero and Adam would turn rounding noise into updates.
    """

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.head_dim = d_model // heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    @property
    def heads(self) -> int:
        return self.q.out_features // self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [batch, tokens, width] -> [batch, heads, tokens, head_dim]; width may be a shard's.
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for p in (self.q, self.k, self.v))
        h = F.scaled_dot_product_attention(q, k, v)
        return self.out(h.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """A post-norm transformer encoder layer (as nn.TransformerEncoderLayer, no dropout)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.attn = Attention(d_model, heads)
        self.norm1 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, 2 * d_model)
        self.ff2 = nn.Linear(2 * d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.ff2(F.relu(self.ff1(x))))


class MeanHead(nn.Module):
    def __init__(self, d_model: int, n_classes: int):
        super().__init__()
        self.linear = nn.Linear(d_model, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.mean(1))


class FeatureTransformer(nn.Sequential):
    """Feature tokens, `layers` encoder blocks, mean-pooled linear head."""

    def __init__(
        self, n_numeric: int, cardinalities: list[int], d_model: int, heads: int, layers: int,
        n_classes: int,
    ):
        super().__init__(
            Tokens(n_numeric, cardinalities, d_model),
            *(Block(d_model, heads) for _ in range(layers)),
            MeanHead(d_model, n_classes),
        )


def _shape(manifest: ShardManifest) -> tuple[int, list[int], int]:
    spec, stats = manifest.feature_spec, manifest.statistics
    return continuous_width(spec), [stats.cardinality[c] for c in spec.categorical], stats.num_classes


def _mlp(manifest: ShardManifest, cfg: TrainingConfig) -> nn.Module:
    n, cards, k = _shape(manifest)
    return TabularMLP(n, cards, cfg.hidden, k, embedding_dim=cfg.embedding_dim)


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


# Tensor-parallel plans: module path -> style. "colwise" splits a Linear's output features
# (its input is whole on every rank); "rowwise" splits its input features and sums the
# ranks' partial outputs. Each colwise run is closed by a rowwise one with only
# elementwise work (or, in attention, per-head work) between: one all-reduce forward and
# one backward per pair, and everything off the plan sees whole activations.


def mlp_tp_plan(model: TabularMLP) -> dict[str, str]:
    """Consecutive Dense layers in pairs; an odd last one and the head stay whole."""
    dense = [i for i, layer in enumerate(model) if isinstance(layer, Dense)]
    plan = {}
    for a, b in zip(dense[0::2], dense[1::2]):
        plan.update({f"{a}.linear": "colwise", f"{b}.linear": "rowwise"})
    return plan


def transformer_tp_plan(model: FeatureTransformer) -> dict[str, str]:
    """Per block: q, k, v by heads then the output projection; ff1 then ff2."""
    blocks = [i for i, layer in enumerate(model) if isinstance(layer, Block)]
    per_block = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.out": "rowwise",
                 "ff1": "colwise", "ff2": "rowwise"}
    return {f"{i}.{path}": style for i in blocks for path, style in per_block.items()}


# Model name -> (its class, its plan).
TP_PLANS: dict[str, tuple[type[nn.Module], Callable[[nn.Module], dict[str, str]]]] = {
    "mlp": (TabularMLP, mlp_tp_plan),
    "transformer": (FeatureTransformer, transformer_tp_plan),
}


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's own tensor-parallel plan; None if its kind has none."""
    for cls, plan in TP_PLANS.values():
        if isinstance(model, cls):
            return plan(model)
    return None


def check_model_name(name: str) -> None:
    if name not in MODELS:
        raise ConfigError(f"training.model: unknown model '{name}' (valid: {', '.join(sorted(MODELS))})")


def build_model(manifest: ShardManifest, cfg: TrainingConfig) -> nn.Module:
    """Build `cfg.model` for the dataset's shape, seeded so every rank starts equal."""
    check_model_name(cfg.model)
    torch.manual_seed(cfg.seed)
    return MODELS[cfg.model](manifest, cfg)


# Layers worth recomputing: the rest (inputs, reshapes, heads) hold little activation.
_RECOMPUTED = (Dense, ConvBlock, Block)


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute the activations of each hidden layer in backward instead of storing them.

    The layer's forward is replaced on the instance, so parameter names (and so
    checkpoints and the logged model) do not change. use_reentrant=False: the
    reentrant variant drops gradients when inputs do not require grad.
    """
    from torch.utils.checkpoint import checkpoint

    for layer in model.modules():
        if isinstance(layer, _RECOMPUTED):
            layer.forward = partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)
    return model
