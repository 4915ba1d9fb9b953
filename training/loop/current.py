"""`shardline.context()`: the rank's loop context, reached from anywhere in a rank's code.

A loop given to `shardline.train` gets its context as its argument; a function written for
torchrun or TorchDistributor and run with `shardline.distribute` takes its own arguments,
and reaches the context (its checkpoints, the restarts' resume) through this call. In
either, code the loop calls deep down reaches it the same way.

Under `shardline.distribute` the context is made at the first call: after the function
joined the process group (`dist.init_process_group(...)`, as under torchrun), or, when it
has not yet, the context joins it from torchrun's variables (`init_method="env://"`) and
the function must not join it again.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

from shardline.foundation.errors import ConfigError

if TYPE_CHECKING:
    from .context import LoopContext

# This process's rank's context, or the function that makes it at the first call (distribute).
_current: LoopContext | Callable[[], LoopContext] | None = None


def context() -> LoopContext:
    """This rank's `LoopContext` (see the module docstring). Outside a rank of
    `shardline.train` or `shardline.distribute`: one line saying so."""
    global _current
    if _current is None:
        raise ConfigError(
            "shardline.context() is called inside a rank: in a function run by shardline.distribute "
            "or a loop run by shardline.train (this process runs neither)"
        )
    if callable(_current):
        _current = _current()
    return _current


def made() -> LoopContext | None:
    """The context, if this rank made it (None: a distributed function that never asked)."""
    return None if _current is None or callable(_current) else _current


@contextmanager
def entered(ctx: LoopContext | Callable[[], LoopContext]):
    """`ctx` (or the function making it) is this rank's while the loop runs; none after."""
    global _current
    _current = ctx
    try:
        yield
    finally:
        _current = None
