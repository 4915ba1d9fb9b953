"""The built-in models, each behind a factory (`mlp`, `cnn`, `transformer`) of the same
protocol as a user's: factory(inputs: ModelInputs, **model_args) -> nn.Module
(training.models.factory, which `training.model = "mlp"` goes through like any import path).

A model never knows how it is parallelised, but declares the plans a strategy needs
(training.models.plans), as torchtitan keeps them beside each model: every built-in is an
`nn.Sequential` of layers, the input layer first (all a pipeline needs to cut it into
stages, and its children with parameters are its FSDP units); `recompute_units()` names
the hidden layers worth recomputing; the mlp and the transformer declare `tp_plan()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from shardline.foundation.errors import ConfigError

from .factory import build_model
from .inputs import ModelInputs
from .plans import recompute_units

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs).


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

    def tp_plan(self) -> dict[str, str]:
        """Consecutive Dense layers in pairs; an odd last one and the head stay whole."""
        dense = [i for i, layer in enumerate(self) if isinstance(layer, Dense)]
        plan = {}
        for a, b in zip(dense[0::2], dense[1::2]):
            plan.update({f"{a}.linear": "colwise", f"{b}.linear": "rowwise"})
        return plan

    def recompute_units(self) -> list[nn.Module]:
        return [layer for layer in self if isinstance(layer, Dense)]


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

    def recompute_units(self) -> list[nn.Module]:
        return [layer for layer in self if isinstance(layer, ConvBlock)]


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

    def tp_plan(self) -> dict[str, str]:
        """Per block: q, k, v by heads then the output projection; ff1 then ff2."""
        blocks = [i for i, layer in enumerate(self) if isinstance(layer, Block)]
        per_block = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.out": "rowwise",
                     "ff1": "colwise", "ff2": "rowwise"}
        return {f"{i}.{path}": style for i in blocks for path, style in per_block.items()}

    def recompute_units(self) -> list[nn.Module]:
        return [layer for layer in self if isinstance(layer, Block)]


# The built-in factories: training.models.factory's protocol, factory(inputs, **model_args).
# A built-in name passes the settings (training.hidden, heads, embedding_dim) as these arguments.


def _tabular(inputs: ModelInputs, name: str) -> None:
    """These models read the features vector: a language model's tokens are not one."""
    if inputs.task == "next_token":
        raise ConfigError(
            f"training.model {name} reads the tabular features; the dataset's task is next_token: "
            "use training.model = 'decoder' (or your own)"
        )


def mlp(inputs: ModelInputs, hidden: Sequence[int] = (128, 64), embedding_dim: int = 8) -> TabularMLP:
    _tabular(inputs, "mlp")
    return TabularMLP(inputs.n_numeric, inputs.cardinalities, list(hidden), inputs.output_width,
                      embedding_dim=embedding_dim)


def cnn(inputs: ModelInputs, hidden: Sequence[int] = (128, 64)) -> FeatureCNN:
    """hidden[0] channels."""
    _tabular(inputs, "cnn")
    return FeatureCNN(inputs.n_numeric, inputs.cardinalities, channels=hidden[0], n_classes=inputs.output_width)


def transformer(inputs: ModelInputs, hidden: Sequence[int] = (128, 64), heads: int = 4) -> FeatureTransformer:
    """hidden[0] is d_model, len(hidden) the encoder blocks."""
    _tabular(inputs, "transformer")
    if hidden[0] % heads:
        raise ConfigError(
            f"training.hidden[0] (d_model {hidden[0]}) must be divisible by training.heads {heads}"
        )
    return FeatureTransformer(inputs.n_numeric, inputs.cardinalities, d_model=hidden[0], heads=heads,
                              layers=len(hidden), n_classes=inputs.output_width)


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute the activations of the model's `recompute_units()` (training.models.plans)
    in backward instead of storing them.

    The layer's forward is replaced on the instance, so parameter names (and so
    checkpoints and the logged model) do not change. use_reentrant=False: the
    reentrant variant drops gradients when inputs do not require grad.
    """
    from torch.utils.checkpoint import checkpoint

    units = recompute_units(model)
    if units is None:
        raise ConfigError(
            f"training.activation_checkpointing: the model ({type(model).__name__}) declares no "
            "recompute_units() or fsdp_units() (the submodules to recompute)"
        )
    for layer in units:
        layer.forward = partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)
    return model
