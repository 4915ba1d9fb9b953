"""Leases: a directory held by one job at a time, on any store, and never wedged by a dead holder.

A lease is one small JSON object (`<dir>/_lease.json`) naming its holder (job,
host, pid, since) and an expiry. It is taken with a create-only write; the holder
renews it from a background thread every third of its time to live, each renewal
a replace-if-unchanged. Anyone may take over a lease that has expired, or whose
holder ran on this same host and whose process is gone (SIGKILL, OOM), again with
replace-if-unchanged, so of two contenders exactly one wins. Release deletes it,
only if it is still ours.

Expiry compares wall clocks of different hosts: they must agree to well within the
time to live (60 s by default; NTP keeps them within milliseconds).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from . import commit, report, storage
from .errors import LeaseHeld, ShardlineError

LEASE_NAME = "_lease.json"
DEFAULT_TTL_S = 60.0


class LeaseLost(ShardlineError):
    """This job's lease was taken over (it stalled past its expiry): it must not commit."""


@dataclass(frozen=True)
class Holder:
    job: str
    host: str
    pid: int
    since: str  # UTC, ISO 8601
    expires_at: float  # Unix time
    boot_id: str = ""  # with host and pid namespace: "the same process table as mine"
    pid_ns: str = ""
    pid_start: str = ""  # the process's start time in clock ticks: pids are reused
    nonce: str = ""

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        try:
            raw = json.loads(data)
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        return f"{self.job} (host {self.host}, pid {self.pid}, since {self.since})"

    def stale(self, now: float) -> str | None:
        """Why this lease may be taken over, or None while its holder is alive."""
        if now > self.expires_at:
            return f"expired {now - self.expires_at:.0f} s ago"
        same_table = ProcessTable(self.host, self.boot_id, self.pid_ns).is_here()
        if same_table and not process_alive(self.pid, self.pid_start):
            return f"its process {self.pid} on this host is gone"
        return None


class Lease:
    """`with Lease(url, "shardline prepare"):` holds `url` for the block, or raises LeaseHeld.

    `took_over` is (previous holder, why) when acquiring replaced a stale lease.
    """

    def __init__(self, url: str, job: str, *, ttl_s: float = DEFAULT_TTL_S, what: str = "directory"):
        self.url, self.job, self.ttl_s, self.what = url, job, ttl_s, what
        self.took_over: tuple[Holder | None, str] | None = None
        self._tag: str | None = None
        self._expires_at = 0.0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since = ""
        self._made_dirs: list[str] = []

    @staticmethod
    def holder(url: str) -> Holder | None:
        got = commit.read_tagged(url)
        return Holder.parse(got[0]) if got else None

    # -- acquire, renew, release -----------------------------------------------------

    def acquire(self) -> Lease:
        self._since = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        # Directories made only to hold the lease go with it: a refused job leaves nothing.
        self._made_dirs = _missing_dirs(storage.parent(self.url))
        for _ in range(20):
            expires_at = time.time() + self.ttl_s
            tag = commit.create_only(self.url, self._body(expires_at))
            if tag is not None:
                return self._held(tag, expires_at)
            got = commit.read_tagged(self.url)
            if got is None:
                continue  # released between our two requests: try to create again
            data, tag = got
            previous = Holder.parse(data)
            why = "unreadable" if previous is None else previous.stale(time.time())
            if why is None:
                left = previous.expires_at - time.time()
                raise LeaseHeld(
                    f"{self.what} {storage.display(storage.parent(self.url))} is in use by "
                    f"{previous.describe()}; its lease ends in {left:.0f} s unless that job "
                    f"renews it (it does while it runs): wait for it, or stop it"
                )
            expires_at = time.time() + self.ttl_s
            new = commit.replace_if(self.url, self._body(expires_at), tag)
            if new is not None:
                self.took_over = (previous, why)
                return self._held(new, expires_at)
        raise LeaseHeld(f"{self.what} {storage.display(storage.parent(self.url))}: contended, try again")

    def renew(self) -> bool:
        """Extend the lease; False once it is lost (someone took it over)."""
        if self._tag is None or self._lost:
            return False
        expires_at = time.time() + self.ttl_s
        try:
            tag = commit.replace_if(self.url, self._body(expires_at), self._tag)
        except Exception as e:  # a store hiccup: keep the lease until it would expire
            if time.time() > self._expires_at:
                self._lost = f"could not renew it before it expired ({e})"
            return not self._lost
        if tag is None:
            holder = self.holder(self.url)
            self._lost = f"taken over by {holder.describe()}" if holder else "deleted by someone else"
            return False
        self._tag, self._expires_at = tag, expires_at
        return True

    def check(self) -> None:
        """Raise LeaseLost if the lease is no longer ours: call it before committing."""
        if self._lost or self._tag is None:
            raise LeaseLost(
                f"{self.what} {storage.display(storage.parent(self.url))}: this job lost its lease "
                f"({self._lost or 'never held'}); nothing more is committed"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._tag is not None and not self._lost:
            commit.delete_if(self.url, self._tag)
            for d in self._made_dirs:  # deepest first; one that holds anything stays
                storage.remove_empty_dir(d)
        self._tag = None

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # -- internals ---------------------------------------------------------------------

    def _held(self, tag: str, expires_at: float) -> Lease:
        self._tag, self._expires_at = tag, expires_at
        # Temporaries of a holder killed mid-write; a live contender's lives for milliseconds.
        commit.remove_stale_temps(self.url, older_than_s=self.ttl_s)
        if self.took_over is not None:
            previous, why = self.took_over
            who = previous.describe() if previous else "an unreadable lease"
            report.line(f"[shardline] took over the lease of {storage.display(self.url)} from {who}: {why}")
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="shardline-lease", daemon=True)
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            if not self.renew():
                report.line(f"[shardline] lost the lease of {storage.display(self.url)}: {self._lost}")
                return

    def _body(self, expires_at: float) -> bytes:
        me = ProcessTable.here()
        holder = Holder(
            job=self.job, host=me.host, pid=os.getpid(), since=self._since,
            expires_at=expires_at, boot_id=me.boot_id, pid_ns=me.pid_ns,
            pid_start=process_start_ticks(os.getpid()) or "", nonce=uuid.uuid4().hex,
        )
        return json.dumps(asdict(holder), indent=1).encode()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcessTable:
    """Whose process table a pid is in: its host, that host's boot and the pid namespace.
    A pid recorded with one means something only where all three are the same."""

    host: str
    boot_id: str
    pid_ns: str

    @classmethod
    def here(cls) -> ProcessTable:
        try:
            pid_ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_ns = ""
        return cls(socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), pid_ns)

    def is_here(self) -> bool:
        """This process's own table (without a boot id and pid namespace to compare: no)."""
        return bool(self.boot_id and self.pid_ns) and self == ProcessTable.here()


def process_start_ticks(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time), None if the process is gone or a zombie."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if fields[0] == "Z":  # killed, not yet reaped by its parent: gone all the same
        return None
    return fields[19]


def process_alive(pid: int, start: str) -> bool:
    """Process `pid` of this table runs, and is the one that started at `start` (clock ticks,
    process_start_ticks; "" for any): pids are reused."""
    ticks = process_start_ticks(pid)
    return ticks is not None and (not start or ticks == start)


def _missing_dirs(url: str) -> list[str]:
    """`url` and its ancestors that do not exist yet, deepest first (local paths only:
    object stores have no directories to leave behind)."""
    if storage.is_remote(url):
        return []
    missing = []
    while not storage.exists(url) and storage.parent(url) != url:
        missing.append(url)
        url = storage.parent(url)
    return missing
