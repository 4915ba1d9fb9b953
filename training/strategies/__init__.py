"""Parallel strategies by name, behind `Strategy` (base.py): ddp, fsdp, tensor and pipeline
are shorthands for one device mesh (mesh.py, applied in parallelize.py's order); ps is its own."""

from __future__ import annotations

from importlib import import_module

from shardline.foundation.errors import ConfigError

from ..config import TrainingConfig
from .base import Strategy

# name -> "module:class"; imported on use, so a strategy's dependencies load only when chosen.
STRATEGIES: dict[str, str] = {
    "ddp": "mesh:MeshStrategy",
    "fsdp": "mesh:MeshStrategy",
    "ps": "ps:ParameterServer",
    "pipeline": "mesh:MeshStrategy",
    "tensor": "mesh:MeshStrategy",
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
