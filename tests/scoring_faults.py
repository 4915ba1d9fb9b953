"""Models that make a scoring worker process really die at a chosen point of a unit.

They are registered in MLflow like any model and loaded by the real workers, so the
fault happens inside a real Spark or Dask task, with no engine or file API mocked:

- `StallsOnce`: the first call in the whole test announces its process and waits
  for the test to SIGKILL it from outside, so the kill lands while that worker is
  in the middle of a unit (its temp file open) and others are committing theirs.
- `DiesBetweenOutputAndLedger`: the first process that publishes a unit's output
  file and then starts writing the ledger SIGKILLs itself at that instant, after
  the output's rename and before its ledger entry. The point is found with a
  Python audit hook (`sys.addaudithook`): the rename of a `scores-*` file, then
  the first write under `_ledger`. Local output only: that is where file
  operations pass through Python's audited calls.

Each fires once per test (a marker file created with O_EXCL says it fired, and
what the output directory held at that instant), so the engine's retry or the
next job runs clean.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

STALL_LIMIT_S = 600  # a stalled unit no one kills gives up (and the test fails on it)
_HOOKED: set[str] = set()  # markers whose hook this process has installed


def _claim(marker: str) -> int | None:
    """An fd on the newly created marker, or None if another call claimed it first."""
    try:
        return os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None


def _publish(path: str, record: dict) -> None:
    """Write `record` whole under `path` (a reader never sees half of it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _FaultModel(torch.nn.Module):
    """The trained model, scoring as usual, plus a marker file naming this test's fault."""

    def __init__(self, inner: torch.nn.Module, marker: str):
        super().__init__()
        self.inner = inner
        self.marker = marker


class StallsOnce(_FaultModel):
    """The first call in the whole test waits, mid-unit, to be killed; the rest score."""

    def forward(self, x):
        fd = _claim(self.marker)
        if fd is None:
            return self.inner(x)
        os.close(fd)
        _publish(f"{self.marker}.json", {"pid": os.getpid()})
        deadline = time.monotonic() + STALL_LIMIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError(f"stalled unit was not killed within {STALL_LIMIT_S} s")


class DiesBetweenOutputAndLedger(_FaultModel):
    """Scores normally; installs, once per process, the hook that dies at the point."""

    def forward(self, x):
        if self.marker not in _HOOKED:
            _HOOKED.add(self.marker)
            sys.addaudithook(_die_between_output_and_ledger(self.marker))
        return self.inner(x)


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _writes_under_ledger(event: str, args: tuple) -> bool:
    """Does this audited call create or change something under a `_ledger` directory?"""
    if event == "open":  # open() and os.open(): (path, mode, flags)
        path, _, flags = args
        if not (isinstance(flags, int) and flags & _WRITE_FLAGS):
            return False
    elif event == "os.mkdir":  # (path, mode, dir_fd)
        path = args[0]
    elif event in ("os.link", "os.rename", "os.symlink"):  # (src, dst, ...): the name made
        path = args[1]
    else:
        return False
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    parts = os.fsdecode(os.fspath(path)).split(os.sep)
    return "_ledger" in parts


def _die_between_output_and_ledger(marker: str):
    state = {"output": None, "busy": False, "done": False}

    def hook(event: str, args: tuple) -> None:
        if state["busy"] or state["done"]:
            return
        if event == "os.rename" and os.path.basename(os.fsdecode(args[1])).startswith("scores-"):
            # Raised just before the rename runs: the output is in place from the next call on.
            state["output"] = os.fsdecode(args[1])
            return
        if state["output"] is None or not _writes_under_ledger(event, args):
            return
        state["busy"] = True  # our own file calls below raise events too
        try:
            fd = _claim(marker)
            if fd is None:
                state["done"] = True
                return
            os.close(fd)
            output = state["output"]
            ledger = os.path.join(os.path.dirname(output), "_ledger")
            named = False
            for root, _, files in os.walk(ledger):
                for f in files:
                    with open(os.path.join(root, f), "rb") as entry:
                        named = named or os.path.basename(output).encode() in entry.read()
            _publish(f"{marker}.json", {
                "pid": os.getpid(), "output": output, "event": event,
                "output_in_place": os.path.isfile(output), "named_in_ledger": named,
            })
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            state["busy"] = False

    return hook
