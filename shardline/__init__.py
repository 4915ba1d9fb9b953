"""shardline: raw data to a trained, tracked PyTorch model and scored outputs, on Spark and Dask.

Installed, everything lives under this one name, so a user's own `training/`,
`jobs/` or `pipelines/` packages never clash with ours: `shardline.pipelines`,
`shardline.training`, `shardline.serving`, `shardline.jobs`, `shardline.benchmarks`.
In the repository those packages are the top-level folders beside this one (the
data flow reads left to right there); pyproject.toml maps them under `shardline`.

The Python API is imported lazily, so that `import shardline` on an executor (which
only needs the engine packages) pulls in neither Spark nor MLflow.
"""

from __future__ import annotations

import os as _os

# A reused Spark Python worker can sit in a working folder that was removed (a Spark
# Connect server runs a session's workers in that session's artifact folder). torch
# imported there aborts the process at its first matrix product ("Intel oneMKL FATAL
# ERROR: Cannot load .../libtorch_cpu.so"), which Spark reports only as a crashed Python
# worker; a CI run met it, every rank and every restart, on the suite's Connect server.
# Moving out after torch's import is too late, and every task imports this package first
# (its function is pickled by reference to a shardline module), so it happens here. Any
# folder will do: shardline's tasks use no relative paths.
try:
    _os.getcwd()
except FileNotFoundError:
    import tempfile as _tempfile

    _os.chdir(_tempfile.gettempdir())

# In a source checkout (an editable install, or PYTHONPATH=<repo>), the engine packages
# sit beside this folder; installed or shipped in the code zip, they sit inside it.
_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "pipelines")):
    _repo = _os.path.dirname(_here)
    if _os.path.isfile(_os.path.join(_repo, "pipelines", "__init__.py")):
        __path__.append(_repo)  # noqa: F821 - a package's own __path__

__version__ = "0.1.0"

_API = {
    "prepare": "api", "train": "api", "score": "api", "run": "api", "score_status": "api", "load_config": "api",
    "PrepareResult": "api", "TrainResult": "api", "ScoreResult": "api", "RunResult": "api",
}


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(f"shardline.{_API[name]}"), name)
    raise AttributeError(f"module 'shardline' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
