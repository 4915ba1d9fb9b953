"""The job's strategy applied where a loop asks for it: `ctx.prepare` (a module the loop
steps itself) and `ctx.parallel` (the strategy's own step, as shardline's loop runs it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardline.foundation.errors import ConfigError

from ..models.builtin import apply_activation_checkpointing
from ..models.plans import recompute_units

if TYPE_CHECKING:
    from ..strategies.base import Parallel
    from .context import LoopContext, OptimizerFactory


def prepare_module(ctx: LoopContext, model: nn.Module, optimizer_factory: OptimizerFactory | None):
    """ctx.prepare (see its docstring): activation checkpointing and precision on the plain
    module, then the strategy's wrapping or sharding (Strategy.prepare_module)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"ctx.prepare: takes an nn.Module, not a {type(model).__name__}")
    cfg = ctx.config
    _recompute(ctx, model, "ctx.prepare")
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
    (the plain model on the rank's device where the strategy takes a built one)."""
    strategy = ctx._strategy
    if isinstance(model, nn.Module):
        job_model = id(model) in ctx._job_models
        _recompute(ctx, model, "ctx.parallel")
        given = model if strategy.builds_model else model.to(ctx.device)
    elif callable(model):
        job_model = model == ctx.build_model
        build = model

        def built() -> nn.Module:  # fsdp calls it under torch.device("meta") too
            return _recompute(ctx, build(), "ctx.parallel")

        given = strategy.model_for(built, ctx.device)
    else:
        raise ConfigError(f"ctx.parallel: takes an nn.Module or a function building one, not a {type(model).__name__}")
    parallel = strategy.setup(given, ctx.config, ctx.rank, ctx.world_size, ctx.device, optimizer_factory)
    if loss_fn is not None:
        parallel.loss = loss_fn  # every strategy's step computes its loss through this attribute
    ctx._data = (parallel.data_rank, parallel.data_world)
    if job_model:
        ctx._job_models.add(id(parallel))
    return parallel


def _recompute(ctx: LoopContext, model: nn.Module, call: str) -> nn.Module:
    """training.activation_checkpointing applied to the model's recompute_units()."""
    if not ctx.config.activation_checkpointing:
        return model
    if recompute_units(model) is None:
        raise ConfigError(
            f"training.activation_checkpointing: {call}: {type(model).__name__} declares no "
            "recompute_units() or fsdp_units() (the submodules to recompute)"
        )
    return apply_activation_checkpointing(model)
