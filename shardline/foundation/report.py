"""How shardline tells its user what it is doing: one reporter per process.

The library never prints. Every stage's start and end, every note under a stage, every
status line (`[shardline] resuming from ...`) and every warning goes through the process's
reporter, which whoever runs the library chooses once:

- `PlainReporter` (the default): plain lines on stderr. A notebook, a script and a
  spark-submit driver's log see the same words the CLI shows, with no markup.
- `LoggingReporter`: each line a record of the `shardline` logger (INFO; warnings at
  WARNING), for a program that routes its own logs: `report.use(report.LoggingReporter())`.
- The `shardline` command sets its own (jobs.cli: rich's console on stderr, stage marks and
  colours), so the library knows nothing of any command line.

Lines from ranks and tasks on other hosts reach the driver through foundation.progress and
are handed to the same reporter (`line`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Reporter:
    """What a reporter is told. Text is plain (no markup): a reporter that renders markup
    escapes it."""

    def stage_started(self, title: str) -> None:
        self.line(f"→ {title} …")

    def stage_done(self, title: str, seconds: float) -> None:
        self.line(f"✓ {title} ({seconds:.1f} s)")

    def note(self, text: str) -> None:
        """A detail of the stage under way: what was inferred, chosen or found."""
        self.line(f"  {text}")

    def warn(self, text: str) -> None:
        """Something the user should act on, though the work goes on."""
        self.line(f"  {text}")

    def line(self, text: str) -> None:
        """A line as it is (a rank's progress, a `[shardline] ...` status line)."""
        raise NotImplementedError


class PlainReporter(Reporter):
    """Lines on a stream (stderr unless given), flushed at once: a driver's log interleaves
    them with the engines' own output in the order they happened."""

    def __init__(self, stream=None):
        self._stream = stream

    def line(self, text: str) -> None:
        stream = self._stream or sys.stderr  # looked up at each line: a caller may swap sys.stderr
        with _LOCK:
            print(text, file=stream, flush=True)


class LoggingReporter(Reporter):
    """Records of the `shardline` logger, for programs that route their logs themselves."""

    def __init__(self, logger: logging.Logger | None = None):
        self._log = logger or logging.getLogger("shardline")

    def warn(self, text: str) -> None:
        self._log.warning(text)

    def line(self, text: str) -> None:
        self._log.info(text)


_LOCK = threading.Lock()
_current: Reporter = PlainReporter()


def use(reporter: Reporter) -> Reporter:
    """Make `reporter` this process's; returns the one it replaces (to put it back)."""
    global _current
    previous, _current = _current, reporter
    return previous


def current() -> Reporter:
    return _current


@contextmanager
def using(reporter: Reporter) -> Iterator[Reporter]:
    """`reporter` for the block, the previous one after."""
    previous = use(reporter)
    try:
        yield reporter
    finally:
        use(previous)


@contextmanager
def stage(title: str) -> Iterator[None]:
    """One line when a stage starts and one when it ends, with its wall time. A stage that
    fails says nothing more: the error is the news."""
    _current.stage_started(title)
    start = time.perf_counter()
    yield
    _current.stage_done(title, time.perf_counter() - start)


def note(text: str) -> None:
    _current.note(text)


def warn(text: str) -> None:
    _current.warn(text)


def line(text: str) -> None:
    _current.line(text)
