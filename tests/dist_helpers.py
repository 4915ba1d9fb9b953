"""Rank functions for tests; importable by spawned processes and Spark workers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.models import TabularMLP
from training.strategies import get_strategy


def global_batches(steps: int, batch: int, n_numeric: int = 5, card: int = 4, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        num = torch.randn(batch, n_numeric, generator=g)
        cat = torch.randint(0, card + 1, (batch, 1), generator=g).float()
        yield torch.cat([num, cat], 1), torch.randint(0, 3, (batch,), generator=g)


def train_steps(rank: int, world_size: int, args: dict) -> dict:
    """`steps` optimizer steps; rank r takes slice r of every global batch."""
    torch.manual_seed(0)
    model = TabularMLP(5, [4], [16, 8], 3, embedding_dim=3)
    strategy = get_strategy(args["strategy"]) if world_size > 1 else None
    wrapped = strategy.wrap(model) if strategy else model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    local = args["batch"] // world_size
    for x, y in global_batches(args["steps"], args["batch"]):
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        loss = F.cross_entropy(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    plain = strategy.unwrap(wrapped) if strategy else model
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}
