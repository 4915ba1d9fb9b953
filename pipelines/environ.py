"""Process-environment changes that are put back afterwards.

Spark and Dask workers, and the driver, outlive one job: a variable set for one job
(bind address, log configuration, a rank's network interface) must not leak into the next.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


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
