"""Ranks never outlive their job, and a rank's failure reaches the driver as one line.

**No orphans.** The driver holds the checkpoint directory's lease
(`pipelines.lease`) while its ranks run and renews it every third of its time to
live. Each rank runs a `DriverGuard` thread that reads the lease every few seconds
and ends its own process when the job is gone: the lease released, taken over by
another job, or not renewed past its expiry (a SIGKILLed driver, a lost host). This
works on every launcher and host, since the lease lives where every host sees it.
On the driver's own host the guard also watches the driver's process (once a
second), and the local launcher's ranks ask the kernel to kill them with their
parent (PR_SET_PDEATHSIG; the fork server they come from exits with the driver).

**Transient or permanent.** `run_in_group` turns a rank's exception into a
`RankError` whose text carries a marker (rank, host, whether a restart can fix it,
the error's first line). It survives every launcher's way of reporting a failure:
a queue (local), a pickled exception (Dask), a Python traceback inside a Java one
(Spark). `rank_failures` reads the markers back on the driver. Only a lost peer
(a killed process, a broken connection, a timeout) is transient; a permission
error, a full disk, bad data or config, or a bug would fail the same way again.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from shardline.pipelines import failures

_MARK = re.compile(r"<<shardline-rank (\{.*?\})>>")
_LOST_PEER_TEXT = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out",
                   "timed out", "Connection refused", "Socket Timeout")


class RankError(Exception):
    """A rank's failure, with the marker the driver reads (one string arg: it pickles)."""

    @classmethod
    def of(cls, rank: int, e: BaseException) -> RankError:
        info = {"rank": rank, "host": socket.gethostname(), "permanent": is_permanent(e),
                "error": error_line(e)}
        return cls(f"<<shardline-rank {json.dumps(info)}>>")


def error_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def is_permanent(e: BaseException) -> bool:
    """Would a relaunch from the last checkpoint fail the same way?"""
    from shardline.pipelines.errors import ShardlineError

    from . import TrainingFailed

    if isinstance(e, RankError):
        return any(f["permanent"] for f in rank_failures(str(e)))
    if isinstance(e, ShardlineError) and not isinstance(e, TrainingFailed):
        return True  # bad config, data or storage, or a lease another job took over
    if isinstance(e, ConnectionError | TimeoutError | EOFError):
        return False
    if failures.is_permanent(e):  # the rule prepare, scoring and storage use too
        return True
    text = str(e)
    if _is_dist_error(e) or any(t in text for t in _LOST_PEER_TEXT):
        return False  # a peer is gone: the relaunch brings it back
    return not isinstance(e, KeyboardInterrupt | SystemExit)


def _is_dist_error(e: BaseException) -> bool:
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    return dist_error is not None and isinstance(e, dist_error)


def rank_failures(text: str) -> list[dict]:
    """The rank markers in an error's text, one per rank (the first seen)."""
    found: dict[int, dict] = {}
    for m in _MARK.finditer(text):
        try:
            info = json.loads(m.group(1))
        except ValueError:
            continue
        found.setdefault(info["rank"], info)
    return [found[r] for r in sorted(found)]


def describe_failures(failures: list[dict]) -> str:
    """One line: the permanent errors if any (the cause), else every rank's."""
    shown = [f for f in failures if f["permanent"]] or failures
    return "; ".join(f"rank {f['rank']} on {f['host']}: {f['error']}" for f in shown)


# -- the driver's heartbeat, watched from each rank ------------------------------------


@dataclass(frozen=True)
class DriverGuard:
    """Who the driver is and where its lease lives; pickled into every rank."""

    lease_url: str
    job: str  # the lease's holder name, unique to this job
    ttl_s: float
    host: str = ""
    boot_id: str = ""
    pid_ns: str = ""  # with host and boot id: "the same process table as mine"
    pid: int = 0
    pid_start: str = ""

    @classmethod
    def for_this_process(cls, lease_url: str, job: str, ttl_s: float) -> DriverGuard:
        from shardline.pipelines.lease import ProcessTable, process_start_ticks

        me = ProcessTable.here()
        return cls(lease_url, job, ttl_s, me.host, me.boot_id, me.pid_ns, os.getpid(),
                   process_start_ticks(os.getpid()) or "")

    def start(self) -> threading.Event:
        """Watch from a daemon thread until the returned event is set."""
        stop = threading.Event()
        threading.Thread(target=self._watch, args=(stop,), name="shardline-driver-guard", daemon=True).start()
        return stop

    def gone(self) -> str | None:
        """Why this rank's job is over, or None while its driver holds the lease."""
        from shardline.pipelines.lease import Lease

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
        from shardline.pipelines.lease import ProcessTable, process_alive

        # A Dask worker or Spark executor on this host may sit in another pid namespace
        # (a container): there the driver's pid means nothing, and only the lease counts.
        same_table = ProcessTable(self.host, self.boot_id, self.pid_ns).is_here()
        return same_table and not process_alive(self.pid, self.pid_start)

    def _watch(self, stop: threading.Event) -> None:
        next_lease_look = time.monotonic() + self.ttl_s / 6
        while not stop.wait(1.0):
            why = "its driver process is gone" if self._driver_dead() else None
            if why is None and time.monotonic() >= next_lease_look:
                why, next_lease_look = self.gone(), time.monotonic() + self.ttl_s / 6
            if why and not stop.is_set():
                print(f"[shardline] rank process {os.getpid()} stops: job {self.job} is over ({why})",
                      file=sys.stderr, flush=True)
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
