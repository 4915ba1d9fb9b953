"""Model factories: factory(inputs, **training.model_args) -> nn.Module."""

import torch
from torch import nn


class Features(nn.Module):
    """The features tensor: the numerics as they are, each category index through an
    embedding (index 0 is the unknown bucket), then a Linear and a ReLU to `width`."""

    def __init__(self, n_numeric: int, cardinalities: list[int], width: int):
        super().__init__()
        self.n_numeric = n_numeric
        self.embeddings = nn.ModuleList(nn.Embedding(c + 1, 4) for c in cardinalities)
        self.linear = nn.Linear(n_numeric + 4 * len(cardinalities), width)

    def forward(self, x):
        parts = [x[:, : self.n_numeric]]
        for i, emb in enumerate(self.embeddings):
            parts.append(emb(x[:, self.n_numeric + i].long().clamp(0, emb.num_embeddings - 1)))
        return torch.relu(self.linear(torch.cat(parts, 1)))


class Residual(nn.Module):
    """x + down(relu(up(x))): up splits by output features, down by input features."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Not an nn.Sequential: it declares its plans itself (shardline.training.models.plans)."""

    def __init__(self, inputs, width: int, depth: int):
        super().__init__()
        self.features = Features(inputs.n_numeric, inputs.cardinalities, width)
        self.blocks = [f"block{i}" for i in range(depth)]
        for name in self.blocks:
            self.add_module(name, Residual(width))
        self.head = nn.Linear(width, inputs.output_width)

    def forward(self, x):
        h = self.features(x)
        for name in self.blocks:
            h = getattr(self, name)(h)
        return self.head(h)

    def tp_plan(self):
        return {f"{b}.{p}": s for b in self.blocks for p, s in (("up", "colwise"), ("down", "rowwise"))}

    def pipeline_layers(self):
        return ["features", *self.blocks, "head"]

    def fsdp_units(self):
        return [self.features, *(getattr(self, b) for b in self.blocks), self.head]

    def recompute_units(self):
        return [getattr(self, b) for b in self.blocks]


def build(inputs, width: int = 16, depth: int = 1) -> Net:
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    return Net(inputs, width, depth)


class Plain(nn.Module):
    """Declares no plan: data parallel strategies take it, tensor and pipeline cannot."""

    def __init__(self, inputs):
        super().__init__()
        self.a = nn.Linear(inputs.feature_width, 8)
        self.b = nn.Linear(8, inputs.output_width)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def plain(inputs) -> Plain:
    return Plain(inputs)


def wrong_width(inputs) -> nn.Module:
    """One output more than the dataset has classes."""
    return nn.Linear(inputs.feature_width, inputs.output_width + 1)


def not_a_module(inputs):
    return {"weights": [1.0]}


NOT_CALLABLE = 3
