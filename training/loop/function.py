"""How a user's loop travels to the ranks, and its check on the driver.

A loop in an importable module travels by reference: its import path (`training.loop =
"pkg.module:function"`), with the user's package shipped in the job's code snapshot as a
factory model's is (training.user_code.job_code_folders), so every rank and every restart
imports the snapshot's version — editing the loop's file and training again in the same
Python runs the new code. A function no rank can import (defined in a notebook, a
script's `__main__`, or inside another function) travels by value, pickled with
cloudpickle as PySpark's TorchDistributor sends its function; what it uses from the
user's own modules is imported on the rank (those folders go in `training.code_paths`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

from shardline.foundation.errors import ConfigError

from ..user_code import import_user_object

SETTING = "training.loop"


@dataclass(frozen=True)
class LoopFunction:
    """The job's loop: `path` ("pkg.module:function"; for one sent by value, where it was
    defined), and `pickled`, its cloudpickle bytes when it travels by value (else None)."""

    path: str
    pickled: bytes | None = None

    @classmethod
    def of(cls, fn: Callable) -> LoopFunction:
        """A callable given to `shardline.train(loop=fn)`: by reference when a rank can import
        it by its module and name (the module's file as it is then, edited since or not: the
        job ships the code as it is), else by value."""
        check_signature(fn, getattr(fn, "__qualname__", repr(fn)))
        return cls.travelling(fn)

    @classmethod
    def travelling(cls, fn: Callable) -> LoopFunction:
        """Any function as it travels to the ranks (by reference or by value, as `of` says),
        whatever it takes: `shardline.distribute`'s, called with its own arguments."""
        module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        path = f"{module}:{name}"
        if module not in (None, "__main__", "__mp_main__") and "<" not in name and _has(module, name):
            return cls(path)
        import cloudpickle

        return cls(path, cloudpickle.dumps(fn))

    @property
    def by_value(self) -> bool:
        return self.pickled is not None

    @property
    def identity(self) -> str:
        """What the checkpoints' fingerprint keeps of it: the path, and for a function sent
        by value the digest of its pickle (a resume after editing it names the loop)."""
        if self.pickled is None:
            return self.path
        return f"{self.path} (by value, {hashlib.sha256(self.pickled).hexdigest()[:12]})"

    def load(self, code_paths: list[str] = ()) -> Callable:
        """The function, in a rank (after the job's code is current there: foundation.code_travel.use_code)."""
        if self.pickled is not None:
            import cloudpickle

            return cloudpickle.loads(self.pickled)
        return import_user_object(self.path, SETTING, list(code_paths))


def _has(module: str, name: str) -> bool:
    """`module` imports (already imported, or now) and has an attribute at `name`."""
    try:
        found = sys.modules.get(module) or importlib.import_module(module)
    except Exception:  # noqa: BLE001 - not importable here: it travels by value
        return False
    for part in name.split("."):
        found = getattr(found, part, None)
    return callable(found)


def resolve(cfg, fn: Callable | None = None) -> LoopFunction | None:
    """The job's loop: `fn` (the API's `loop=`), else `training.loop` imported and checked on
    the driver (a function of a script's `__main__` travels by value); None: the built-in loop."""
    if fn is not None:
        return LoopFunction.of(fn)
    if cfg.loop is None:
        return None
    found = import_user_object(cfg.loop, SETTING, cfg.code_paths)
    check_signature(found, cfg.loop)
    return LoopFunction.of(found) if getattr(found, "__module__", None) in ("__main__", "__mp_main__") \
        else LoopFunction(cfg.loop)


def check_signature(fn, path: str) -> None:
    """A loop is a callable of exactly one positional argument (the context); one line if not."""
    if not callable(fn):
        raise ConfigError(f"{SETTING}: {path} is not callable (it is a {type(fn).__name__})")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call will tell
        return
    try:
        signature.bind(None)
    except TypeError:
        raise ConfigError(
            f"{SETTING}: {path}{signature} must take exactly one positional argument, the loop "
            "context (def loop(ctx): ...)"
        ) from None
