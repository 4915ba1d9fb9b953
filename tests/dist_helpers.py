"""Rank functions for tests; importable by spawned processes, Spark and Dask workers."""

from __future__ import annotations

import torch

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
    """`steps` optimizer steps of `strategy` over `world_size` ranks; the rank reads
    slice data_rank of every global batch. world_size 1 is single-process training.

    args: strategy, steps, batch, and optionally model and cfg (TrainingConfig fields:
    precision, activation_checkpointing, grad_compression, dp/tp/pp, ps_*, micro_batches ...).
    Returns the plain model's weights after training (every rank: full_state_dict()).
    """
    strategy = args["strategy"] if world_size > 1 else "ddp"
    settings = args.get("cfg", {}) if world_size > 1 else _numerics(args.get("cfg", {}))
    cfg = TrainingConfig(world_size=world_size, strategy=strategy, batch_size=args["batch"], **settings)
    torch.manual_seed(0)
    model = MODELS[args.get("model", "mlp")]()
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    get_strategy(strategy).check(cfg, model)
    # SGD, not Adam: Adam divides by sqrt(v), which blows rounding noise in gradients
    # that are zero in exact arithmetic (attention's key bias) up to whole steps.
    parallel = get_strategy(strategy).setup(
        model, cfg, rank, world_size, torch.device("cpu"), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    for x, y in global_batches(args["steps"], args["batch"]):
        if parallel.data_rank is None:
            parallel.step(None, None)
            continue
        local = args["batch"] // parallel.data_world
        part = slice(parallel.data_rank * local, (parallel.data_rank + 1) * local)
        parallel.step(x[part], y[part])
    return {k: v.detach().clone() for k, v in parallel.full_state_dict().items()}


def _numerics(cfg: dict) -> dict:
    """The settings that change single-process arithmetic (the reference keeps them)."""
    keep = ("precision", "activation_checkpointing")
    return {k: v for k, v in cfg.items() if k in keep}
