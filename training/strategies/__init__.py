"""Parallel strategies by name: each one small file behind `Strategy`."""

from __future__ import annotations

from pipelines.errors import ConfigError

from .base import Strategy
from .ddp import DataParallel

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DataParallel}


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ConfigError(
            f"training.strategy: unknown strategy '{name}' "
            f"(valid: {', '.join(sorted(STRATEGIES))})"
        )
    return STRATEGIES[name]()
