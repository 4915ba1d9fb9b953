"""The job's strategy applied where a loop asks for it: `ctx.prepare` (a module the loop
steps itself) and `ctx.parallel` (the strategy's own step, as shardline's loop runs it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardline.foundation.errors import ConfigError

if TYPE_CHECKING:
    from ..strategies.base import Parallel
    from .context import LoopContext, OptimizerFactory


def prepare_module(ctx: LoopContext, model: nn.Module, optimizer_factory: OptimizerFactory | None):
    """ctx.prepare (see its docstring): precision's autocast on the plain module's forward,
    then the strategy's mesh (Strategy.prepare_module: tensor parallel, activation
    checkpointing, data parallel, in strategies.parallelize's order)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"ctx.prepare: takes an nn.Module, not a {type(model).__name__}")
    cfg = ctx.config
    if cfg.precision == "bf16":
        # On the instance, as activation checkpointing does: the parameter names (so the
        # checkpoints and the registered weights) stay the plain module's.
        model.forward = torch.autocast(ctx.device.type, dtype=torch.bfloat16)(model.forward)
    prepared = ctx._strategy.prepare_module(model, cfg, ctx.world_size, ctx.device)
    ctx._plain[id(prepared)] = model  # what ctx.register gathers and rebuilds
    if optimizer_factory is None:
        return prepared
    return prepared, optimizer_factory(prepared.parameters())


def make_parallel(ctx: LoopContext, model: nn.Module | Callable[[], nn.Module], optimizer_factory: OptimizerFactory,
                  loss_fn: Callable | None) -> Parallel:
    """ctx.parallel (see its docstring): Strategy.setup on the model, or on a builder of it
    (the plain model on the rank's device where the strategy takes a built one). The
    strategy applies activation checkpointing itself, in its order (strategies.parallelize)."""
    strategy = ctx._strategy
    if isinstance(model, nn.Module):
        job_model = id(model) in ctx._job_models
        given = model if strategy.builds_model else model.to(ctx.device)
    elif callable(model):
        job_model = model == ctx.build_model
        # A mesh that splits the model calls it under torch.device("meta") too.
        given = strategy.model_for(model, ctx.device)
    else:
        raise ConfigError(f"ctx.parallel: takes an nn.Module or a function building one, not a {type(model).__name__}")
    parallel = strategy.setup(given, ctx.config, ctx.rank, ctx.world_size, ctx.device, optimizer_factory)
    if loss_fn is not None:
        parallel.loss = loss_fn  # every strategy's step computes its loss through this attribute
    ctx._data = (parallel.data_rank, parallel.data_world)
    ctx._parallels.append(parallel)
    if job_model:
        ctx._job_models.add(id(parallel))
    return parallel
