"""shardline: raw data to a trained, tracked PyTorch model and scored outputs, on Spark and Dask.

Installed, everything lives under this one name, so a user's own `training/`,
`jobs/` or `pipelines/` packages never clash with ours: `shardline.pipelines`,
`shardline.training`, `shardline.serving`, `shardline.jobs`, `shardline.benchmarks`.
In the repository those packages are the top-level folders beside this one (the
data flow reads left to right there), and this folder holds a symbolic link to each
(`shardline/training -> ../training`): `shardline.training.job` is the file
`shardline/training/job.py` for Python, an installer and static tools alike.

The Python API is imported lazily, so that `import shardline` on an executor (which
only needs the engine packages) pulls in neither Spark nor MLflow. Type checkers and IDEs
read the same names from the `if TYPE_CHECKING:` imports below, so `shardline.train` has
its real signature for them (the package ships `py.typed`).
"""

# What a user's code calls: type-checked in pyright's basic mode ([tool.pyright] in pyproject.toml).
# pyright: basic
from __future__ import annotations

# The errors a caller catches (`except shardline.ShardlineError`), loaded at once: their
# module imports nothing heavy. `.exit_code` is what the CLI exits with.
from .foundation.errors import ConfigError, DataError, LeaseHeld, ShardlineError, StorageError

__version__ = "0.1.0"

# Not `from typing import TYPE_CHECKING`: importing typing costs `import shardline` a few
# milliseconds; pyright and mypy treat any name TYPE_CHECKING as true, Python sees False.
TYPE_CHECKING = False
if TYPE_CHECKING:
    # `name as name`: a re-export, as PEP 484 asks of a typed package's __init__.
    from .api import (
        PlanResult as PlanResult,
        PrepareResult as PrepareResult,
        RunResult as RunResult,
        ScoreResult as ScoreResult,
        TrainResult as TrainResult,
        load_config as load_config,
        plan as plan,
        prepare as prepare,
        run as run,
        score as score,
        score_status as score_status,
        sweep as sweep,
        train as train,
    )

_API = {
    name: "api" for name in (
        "prepare", "train", "score", "run", "sweep", "plan", "forecast", "score_status", "load_config",
        "PrepareResult", "TrainResult", "ScoreResult", "RunResult", "PlanResult", "ForecastResult",
    )
}
# Raised by a call that ran and failed: a lost lease (a stalled job's folder taken over),
# a rank's failure after its relaunches.
_API |= {"LeaseLost": "foundation.lease", "TrainingFailed": "training.launchers"}
# What a training loop function gets (`def loop(ctx: shardline.LoopContext)`): imports torch.
_API["LoopContext"] = "training.loop.context"
# A function written for torchrun / TorchDistributor, run unchanged; and its rank's context.
_API["distribute"] = "distributor"
_API["context"] = "training.loop.current"
__all__ = ["ShardlineError", "ConfigError", "DataError", "StorageError", "LeaseHeld", *_API, "__version__"]


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(f"shardline.{_API[name]}"), name)
    raise AttributeError(f"module 'shardline' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
