"""Rank functions for tests; importable by spawned processes, Spark and Dask workers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.config import TrainingConfig
from training.models import FeatureCNN, FeatureTransformer, TabularMLP, apply_activation_checkpointing
from training.strategies import get_strategy

MODELS = {
    "mlp": lambda: TabularMLP(5, [4], [16, 8], 3, embedding_dim=3),
    "cnn": lambda: FeatureCNN(5, [4], channels=8, n_classes=3),
    "transformer": lambda: FeatureTransformer(5, [4], d_model=16, heads=4, layers=2, n_classes=3),
}


def global_batches(steps: int, batch: int, n_numeric: int = 5, card: int = 4, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        num = torch.randn(batch, n_numeric, generator=g)
        cat = torch.randint(0, card + 1, (batch, 1), generator=g).float()
        yield torch.cat([num, cat], 1), torch.randint(0, 3, (batch,), generator=g)


def train_steps(rank: int, world_size: int, args: dict) -> dict:
    """`steps` optimizer steps; rank r takes slice r of every global batch.

    args: strategy, steps, batch, and optionally model and cfg (TrainingConfig fields:
    precision, activation_checkpointing, grad_compression).
    """
    cfg = TrainingConfig(**args.get("cfg", {}))
    torch.manual_seed(0)
    model = MODELS[args.get("model", "mlp")]()
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    strategy = get_strategy(args["strategy"]) if world_size > 1 else None
    wrapped = strategy.wrap(model, cfg) if strategy else model
    # SGD, not Adam: Adam divides by sqrt(v), which blows rounding noise in gradients
    # that are zero in exact arithmetic (attention's key bias) up to whole steps.
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
    local = args["batch"] // world_size
    for x, y in global_batches(args["steps"], args["batch"]):
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        with autocast:
            loss = F.cross_entropy(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    plain = strategy.unwrap(wrapped) if strategy else model
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}
