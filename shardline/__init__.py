"""shardline: raw data to a trained, tracked PyTorch model and scored outputs, on Spark and Dask.

Installed, everything lives under this one name, so a user's own `training/`,
`jobs/` or `pipelines/` packages never clash with ours: `shardline.pipelines`,
`shardline.training`, `shardline.serving`, `shardline.jobs`, `shardline.benchmarks`.
In the repository those packages are the top-level folders beside this one (the
data flow reads left to right there), and this folder holds a symbolic link to each
(`shardline/training -> ../training`): `shardline.training.job` is the file
`shardline/training/job.py` for Python, an installer and static tools alike.

The Python API is imported lazily, so that `import shardline` on an executor (which
only needs the engine packages) pulls in neither Spark nor MLflow.
"""

from __future__ import annotations

__version__ = "0.1.0"

_API = {
    name: "api" for name in (
        "prepare", "train", "score", "run", "sweep", "plan", "forecast", "score_status", "load_config",
        "PrepareResult", "TrainResult", "ScoreResult", "RunResult", "PlanResult", "ForecastResult",
    )
}


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(f"shardline.{_API[name]}"), name)
    raise AttributeError(f"module 'shardline' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
