"""Parallel strategies by name: each one small file behind `Strategy` (base.py)."""

from __future__ import annotations

from importlib import import_module

from shardline.pipelines.errors import ConfigError

from .base import Strategy

# name -> "module:class"; imported on use, so a strategy's dependencies load only when chosen.
STRATEGIES: dict[str, str] = {
    "ddp": "ddp:DataParallel",
    "fsdp": "fsdp:FullyShardedDataParallel",
    "ps": "ps:ParameterServer",
    "pipeline": "pipeline:Pipeline",
    "tensor": "tensor:TensorParallel",
}


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ConfigError(
            f"training.strategy: unknown strategy '{name}' "
            f"(valid: {', '.join(sorted(STRATEGIES))})"
        )
    module, cls = STRATEGIES[name].split(":")
    return getattr(import_module(f"{__name__}.{module}"), cls)()
