"""Parallel strategies by name: each one small file behind `Strategy` (base.py)."""

from __future__ import annotations

from importlib import import_module

from shardline.foundation.errors import ConfigError

from ..config import TrainingConfig
from .base import Strategy

# name -> "module:class"; imported on use, so a strategy's dependencies load only when chosen.
STRATEGIES: dict[str, str] = {
    "ddp": "ddp:DataParallel",
    "fsdp": "fsdp:FullyShardedDataParallel",
    "ps": "ps:ParameterServer",
    "pipeline": "pipeline:Pipeline",
    "tensor": "tensor:TensorParallel",
}


def strategy_for(cfg: TrainingConfig) -> Strategy:
    """The job's strategy, `training.strategy`, with its settings and its mesh: looked up once
    per job on the driver, then handed on (it travels to the ranks inside the job). A mesh
    that cannot be laid out is refused here, in one line naming the setting."""
    name = cfg.strategy
    if name not in STRATEGIES:
        raise ConfigError(
            f"training.strategy: unknown strategy '{name}' "
            f"(valid: {', '.join(sorted(STRATEGIES))})"
        )
    module, cls = STRATEGIES[name].split(":")
    return getattr(import_module(f"{__name__}.{module}"), cls)(cfg)
