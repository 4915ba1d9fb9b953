"""Process-environment changes that are put back afterwards.

Spark and Dask workers, and the driver, outlive one job: a variable set for one job
(bind address, log configuration, a rank's network interface) must not leak into the next.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

# Imported inside the functions that use them: cloudpickle (only where a function is shipped).


@contextmanager
def restored(names: Iterable[str]) -> Iterator[None]:
    """Inside the block, change the variables `names` at will; on leaving, each gets back
    the value it had on entry (or is removed again if it was unset)."""
    saved = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def leave_removed_cwd() -> None:
    """Move this process out of its working folder if that folder was removed.

    A reused Spark Python worker can sit in a folder that is gone: a Spark Connect server
    runs a session's workers in that session's artifact folder. torch imported there aborts
    the process at its first matrix product ("Intel oneMKL FATAL ERROR: Cannot load
    .../libtorch_cpu.so"), which Spark reports only as a crashed Python worker; a CI run met
    it on every rank and every restart. Moving out after torch's import is too late, so a
    task that may import torch calls this first thing (`TaskPayload.open`), before anything
    of its payload is unpickled. Any folder will do: shardline's tasks use no relative paths.
    """
    try:
        os.getcwd()
    except FileNotFoundError:
        import tempfile

        os.chdir(tempfile.gettempdir())


class TaskPayload:
    """What a Spark task runs, pickled on the driver and opened in the task, so that nothing
    of it (the rank function's module, a job that imports torch) is imported before the task
    has left a removed working folder (`leave_removed_cwd`). The task function itself then
    only references torch-free modules (the launchers, serving's engines)."""

    def __init__(self, obj):
        import cloudpickle

        self._blob = cloudpickle.dumps(obj)

    def open(self):
        leave_removed_cwd()
        return pickle.loads(self._blob)
