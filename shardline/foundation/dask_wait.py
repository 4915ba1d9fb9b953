"""Waiting on Dask futures in a way a Ctrl-C leaves clean.

`client.gather(futures)` (and `distributed.wait`) wait in a coroutine on the client's event
loop while the calling thread blocks. A Ctrl-C there cancels that coroutine but not the
per-future tasks it started; when the caller then cancels the futures (it must: a running
task is never stopped otherwise), each of those tasks fails with distributed's `AllExit` and
nothing awaits it: asyncio prints "Task exception was never retrieved ... AllExit", one
traceback per future, after the command said "aborted" (seen with Dask 2026.8, #53). Here
the caller's own thread polls the futures' states, which are plain attributes the loop
updates: an interrupt lands in a `time.sleep`, and no coroutine is left behind. Gather
once every future is done, which then waits for nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.05  # how often the states are read (attributes the client's loop updates: nothing is sent); a fit waits twice
ASK_EVERY_S = 2.0  # how often `give_up` is asked (it may ask the scheduler)


def interruptible_wait(futures: list, stop_at_error: bool, deadline: float | None = None,
                       give_up: Callable[[], bool] | None = None) -> None:
    """Until every future is done (finished, failed, cancelled or lost), or one has failed
    (`stop_at_error`), or `deadline` (time.monotonic()) has passed, or `give_up()` says so
    (asked every ASK_EVERY_S: a worker a task is pinned to left, so it never ends)."""
    next_ask = time.monotonic() + ASK_EVERY_S
    while True:
        states = [f.status for f in futures]
        if all(s != "pending" for s in states):
            return
        if stop_at_error and "error" in states:
            return
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return
        if give_up is not None and now >= next_ask:
            if give_up():
                return
            next_ask = now + ASK_EVERY_S
        time.sleep(POLL_S)
