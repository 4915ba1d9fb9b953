"""A user's package for the code-travel tests, and a rank function that imports it.

The Spark and Dask workers under test have neither `tests` nor the user's package: their
rank function is `value_rank()`'s nested copy, which cloudpickle sends by value.
"""

from __future__ import annotations

from pathlib import Path

MODULE = "shipped_pkg.model"


def write_package(root: Path, value: int, name: str = "shipped_pkg") -> Path:
    """`name`/ under `root`: a package whose `model.value()` returns `value` from a sibling
    module (so a stale submodule, not only the package, would show)."""
    pkg = root / name
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "consts.py").write_text(f"VALUE = {value}\n")
    (pkg / "model.py").write_text("from .consts import VALUE\n\n\ndef value():\n    return VALUE\n")
    return pkg


def read_value(rank, world_size, module):
    """A rank function: `module`'s value, where it was imported from, this process."""
    import importlib
    import os

    mod = importlib.import_module(module)
    consts = importlib.import_module(module.rsplit(".", 1)[0] + ".consts")
    return {"value": mod.value(), "file": mod.__file__, "consts": consts.__file__, "pid": os.getpid()}


def value_rank():
    """read_value, for workers without `tests`: a nested copy, which cloudpickle sends by value
    (the local launcher's processes import `tests` and take read_value itself)."""
    def rank_fn(rank, world_size, module):
        import importlib
        import os

        mod = importlib.import_module(module)
        consts = importlib.import_module(module.rsplit(".", 1)[0] + ".consts")
        return {"value": mod.value(), "file": mod.__file__, "consts": consts.__file__, "pid": os.getpid(),
                "ppid": os.getppid()}

    return rank_fn
