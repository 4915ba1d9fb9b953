"""Ranks never outlive their job, and a rank's failure reaches the driver as one line.

**No orphans.** The driver holds the checkpoint directory's lease
(`foundation.lease`) while its ranks run and renews it every third of its time to
live. Each rank runs a `DriverGuard` thread that reads the lease every few seconds
and ends its own process when the job is gone: the lease released, taken over by
another job, or not renewed past its expiry (a SIGKILLed driver, a lost host). This
works on every launcher and host, since the lease lives where every host sees it.
On the driver's own host the guard also watches the driver's process (once a
second), and the local launcher's ranks ask the kernel to kill them with their
parent (PR_SET_PDEATHSIG; the fork server they come from exits with the driver).

**Ctrl-C stops the ranks at once.** A driver interrupted writes the checkpoint store's
stop file (`ranks/stop.json`, `CheckpointStore.stop_file`: its job's name) before it cancels its launch (`DriverGuard.stop`). Each
rank's guard looks for it every second, and rank 0 looks again just before it commits a
checkpoint (`stop_if_job_over`, before `LATEST` moves): a rank of an interrupted job ends
without committing another checkpoint; at most one whose commit had begun completes. The
marker names its job, so a `--resume` after it (a new job) is not stopped by it.

A rank's failure line (transient or permanent, who is named first, a bug's traceback):
training.launchers.rank_errors.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from shardline.foundation import report

from .rank_errors import (  # noqa: F401 - their home before rank_errors; callers import them here
    RankError, describe_failures, is_permanent, rank_failures,
)

# The guard of the rank running in this thread (run_in_group's, which calls the rank function
# in its own thread): a Dask worker's threads may run ranks of different jobs.
_running = threading.local()

# -- the driver's heartbeat, watched from each rank ------------------------------------


@dataclass(frozen=True)
class DriverGuard:
    """Who the driver is and where its lease lives; pickled into every rank."""

    lease_url: str
    stop_url: str  # the checkpoint store's stop file (CheckpointStore.stop_file)
    job: str  # the lease's holder name, unique to this job
    ttl_s: float
    host: str = ""
    boot_id: str = ""
    pid_ns: str = ""  # with host and boot id: "the same process table as mine"
    pid: int = 0
    pid_start: str = ""

    @classmethod
    def for_this_process(cls, lease_url: str, stop_url: str, job: str, ttl_s: float) -> DriverGuard:
        from shardline.foundation.lease import ProcessTable, process_start_ticks

        me = ProcessTable.here()
        return cls(lease_url, stop_url, job, ttl_s, me.host, me.boot_id, me.pid_ns, os.getpid(),
                   process_start_ticks(os.getpid()) or "")

    def start(self) -> threading.Event:
        """Watch from a daemon thread until the returned event is set; until then this
        thread's rank asks it before each commit (stop_if_job_over)."""
        stop = _Watching(self)
        threading.Thread(target=self._watch, args=(stop,), name="shardline-driver-guard", daemon=True).start()
        return stop

    def stop(self) -> None:
        """On the driver, interrupted: tell this job's ranks to stop now (see the module's doc).
        Never raises: the Ctrl-C that called it must still end the job."""
        from shardline.foundation import storage

        try:
            storage.write_bytes(self.stop_url, json.dumps({"job": self.job}).encode())
        except Exception as e:  # noqa: BLE001 - the ranks still stop when the lease is released
            report.line(f"[shardline] could not tell the ranks to stop ({first_line(e, with_type=True)}): they stop when the "
                        "lease is released")

    def interrupted(self) -> bool:
        """On a rank: did this job's driver ask its ranks to stop?"""
        from shardline.foundation import storage

        try:
            return json.loads(storage.read_bytes(self.stop_url)).get("job") == self.job
        except Exception:  # none (the usual case), or unreadable: judge again on the next look
            return False

    def gone(self) -> str | None:
        """Why this rank's job is over, or None while its driver holds the lease."""
        from shardline.foundation.lease import Lease

        try:
            holder = Lease.holder(self.lease_url)
        except Exception:  # the store did not answer: judge again on the next look
            return None
        if holder is None:
            return "its lease was released"
        if holder.job != self.job:
            return f"its lease is now held by {holder.describe()}"
        # A little past expiry: the driver renews at a third of the time to live.
        if time.time() > holder.expires_at + self.ttl_s / 3:
            return f"its driver stopped renewing the lease {time.time() - holder.expires_at:.0f} s ago"
        return None

    def _driver_dead(self) -> bool:
        from shardline.foundation.lease import ProcessTable, process_alive

        # A Dask worker or Spark executor on this host may sit in another pid namespace
        # (a container): there the driver's pid means nothing, and only the lease counts.
        same_table = ProcessTable(self.host, self.boot_id, self.pid_ns).is_here()
        return same_table and not process_alive(self.pid, self.pid_start)

    def _watch(self, stop: threading.Event) -> None:
        next_lease_look = time.monotonic() + self.ttl_s / 6
        while not stop.wait(1.0):
            why = "its driver process is gone" if self._driver_dead() else None
            if why is None and self.interrupted():  # one small read a second: Ctrl-C acts at once
                why = "its driver was interrupted"
            if why is None and time.monotonic() >= next_lease_look:
                why, next_lease_look = self.gone(), time.monotonic() + self.ttl_s / 6
            if why and not stop.is_set():
                _end(self.job, why)


class _Watching(threading.Event):
    """A guard's stop event: while it is unset, the starting thread's rank runs under it."""

    def __init__(self, guard: DriverGuard):
        super().__init__()
        self.guard = guard
        _running.guard = guard

    def set(self) -> None:
        if getattr(_running, "guard", None) is self.guard:
            _running.guard = None
        super().set()


def stop_if_job_over() -> None:
    """Just before a rank commits (a checkpoint's LATEST): end this process if its job was
    interrupted or is gone, so no checkpoint is committed after the driver stopped the job.
    Nothing to do in a thread that runs no guard (a rank function called directly)."""
    guard = getattr(_running, "guard", None)
    if guard is None:
        return
    why = ("its driver was interrupted" if guard.interrupted()
           else "its driver process is gone" if guard._driver_dead() else guard.gone())
    if why:
        _end(guard.job, why)


def stop_line(pid: int, job: str, why: str) -> str:
    return f"[shardline] rank process {pid} stops: job {job} is over ({why})"


def _end(job: str, why: str) -> None:
    print(stop_line(os.getpid(), job, why), file=sys.stderr, flush=True)
    os._exit(70)  # no cleanup that could write: another job may own the directory


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the call took effect
        os._exit(70)
