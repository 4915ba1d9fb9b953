"""Progress lines from ranks and tasks onto the console that started the job.

A rank on a Spark executor or a Dask worker writes to that process's stderr, which on
a cluster is a log file on another host. The driver therefore listens on a TCP port
(`ProgressListener`), on the address the cluster reaches it at, and ranks send their
lines there (`say`): one mechanism for every launcher (local processes, Spark classic
and Connect, Dask), across hosts that share no disk.

Long stages (prepare's passes, scoring) count their units the same way: a task sends a
tick when its unit is done (`tick`, `Counted`), and the listener prints
`<stage>: done/total <units> (rows)` (`ProgressListener.stage`). A retried or duplicated
attempt ticks again: a tick naming its unit counts once, and no count passes its total. The driver knows the
total; the engines report nothing until their job ends, and this works alike on classic
Spark, Spark Connect and Dask without asking any of them.

Bounded by design: a rank connects with a short timeout and sends one line at a time;
if the driver cannot be reached (a firewall, a driver gone), the rank prints the line to
its own stderr as before and stops trying, so training never waits on the console. A
tick that cannot be sent is dropped: a count belongs on the driver's console only.

Only the job's own senders are heard: the port is open to whoever reaches the driver's
host, and a stranger's lines would be printed as the job's (or its ticks counted). The
listener draws a random token per job and puts it in its address (`host:port/token`),
the one string every sender is handed; a sender's first line on a connection is that
token, and a connection that does not start with it is closed unread.
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
import itertools
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import report

CONNECT_TIMEOUT_S = 2.0
DRAIN_S = 1.0  # at most this long the driver waits for lines in flight when the job ends
QUIET_S = 0.2  # ... and no longer than this after the last line arrived
SHOW_EVERY_S = 2.0  # a stage's count is printed at most this often (and always at its end)
KEEP_SENDERS = 8  # connections a task process keeps open, newest first
TICK = "\x1e"  # starts a tick: a unit of a stage done (counted, not printed)


@dataclass
class _Stage:
    label: str
    total: int
    noun: str
    key: str
    done: int = 0
    rows: int = 0
    shown: int = -1
    shown_at: float = 0.0
    units: set[str] = field(default_factory=set)  # the named units counted so far

    def line(self) -> str:
        rows = f" ({self.rows:,} rows)" if self.rows else ""
        # Capped: an unnamed tick (a prepare task) retried after it ticked counts again.
        return f"[shardline] {self.label}: {min(self.done, self.total)}/{self.total} {self.noun}{rows}"


class ProgressListener:
    """A driver-side listener handing every line it receives to this process's reporter
    (foundation.report), or writing it to `out` when one is given."""

    def __init__(self, host: str = "127.0.0.1", out=None, drain: bool = True):
        """drain: wait at the end for free lines in flight (a rank's last epoch line);
        a listener used only for stages has waited for their ticks already."""
        self._out = out
        self._drain = drain
        self._server = socket.create_server((host, 0))
        self._server.settimeout(0.5)
        self._token = secrets.token_hex(16)
        self.address = f"{host}:{self._server.getsockname()[1]}/{self._token}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._readers: list[tuple[threading.Thread, socket.socket]] = []
        self._stages: dict[str, _Stage] = {}
        self._keys = itertools.count()
        self._last = 0.0  # when the last line arrived
        self._thread = threading.Thread(target=self._accept, name="shardline-progress", daemon=True)

    def __enter__(self) -> ProgressListener:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        # Wakes the accept loop now, not at its next 0.5 s timeout (Linux: accept fails).
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self._server.close()
        # Lines still in flight get a moment; then the connections close (a reused Spark
        # Python worker would hold its end open forever; its next line goes to its log).
        deadline = time.monotonic() + DRAIN_S
        while self._drain and time.monotonic() < deadline and time.monotonic() - self._last < QUIET_S:
            time.sleep(0.05)
        for _, conn in self._readers:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    @contextlib.contextmanager
    def stage(self, label: str, total: int, noun: str):
        """Count `label`'s units as tasks report them (`Counted` or `tick` with its `key`),
        printing `label: done/total noun (rows)` as they come, at most every SHOW_EVERY_S,
        and the final count when the block ends. Yields the stage; a caller that learns
        the true total only at the end (empty shards are not written) may lower `total`."""
        st = _Stage(label, total, noun, key=f"s{next(self._keys)}")
        self._stages[st.key] = st
        try:
            yield st
        finally:
            # The engine returned: every task has sent its tick, some may be in flight.
            deadline = time.monotonic() + DRAIN_S
            while st.done < st.total and time.monotonic() < deadline:
                time.sleep(0.02)
            with self._lock:
                if st.shown != min(st.done, st.total):
                    self._show(st)
                del self._stages[st.key]

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._read, args=(conn,), daemon=True)
            self._readers.append((t, conn))
            t.start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("r", encoding="utf-8", errors="replace") as lines:
            conn.settimeout(CONNECT_TIMEOUT_S * 5)  # the token comes at once; a silent peer is dropped
            try:
                first = lines.readline(len(self._token) + 2)
            except OSError:
                return
            if not hmac.compare_digest(first.rstrip("\n").encode(), self._token.encode()):
                return  # not one of this job's senders: nothing it sent is printed or counted
            conn.settimeout(None)
            for line in lines:
                self._last = time.monotonic()
                with self._lock:
                    if line.startswith(TICK):
                        self._count(line[1:].split())
                    else:
                        self._print(line.rstrip("\n"))

    def _count(self, fields: list[str]) -> None:
        st = self._stages.get(fields[0]) if fields else None
        if st is None:
            return  # a tick of a stage that has ended (a straggling duplicate attempt)
        if len(fields) > 2:  # a named unit: a retried attempt that ticks again counts once
            if fields[2] in st.units:
                return
            st.units.add(fields[2])
        st.done += 1
        st.rows += int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0
        if st.shown == st.total:
            return  # the final count is out: a duplicate tick changes nothing shown
        if st.done >= st.total or time.monotonic() - st.shown_at >= SHOW_EVERY_S:
            self._show(st)

    def _print(self, text: str) -> None:
        if self._out is None:
            report.line(text)  # the driver's reporter: the CLI's console, a notebook's stderr
        else:
            print(text, file=self._out, flush=True)

    def _show(self, st: _Stage) -> None:
        self._print(st.line())
        st.shown, st.shown_at = min(st.done, st.total), time.monotonic()


_senders: dict[str, socket.socket | None] = {}


def tick(address: str | None, key: str | None, rows: int = 0, unit: str | None = None) -> None:
    """One unit of the driver's stage `key` is done here (`rows` rows). Silent when there
    is no listener: a count is for the driver's console, not for a task's log. `unit`
    (no spaces), when given, names it: another tick of the same unit is not counted."""
    if address and key:
        _send(address, f"{TICK}{key} {int(rows)}" + (f" {unit}" if unit else ""))


@dataclass(frozen=True)
class Counted:
    """fn, ticking the driver's stage once per call (after a generator is exhausted);
    picklable when fn is, so it travels to tasks in place of fn."""

    fn: Callable
    address: str | None
    key: str | None

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        if inspect.isgenerator(out):
            return self._after(out)
        tick(self.address, self.key)
        return out

    def _after(self, gen):
        yield from gen
        tick(self.address, self.key)


def say(address: str | None, line: str) -> None:
    """Send `line` to the driver's listener at `address`; print it here if there is none
    or it cannot be reached (then stop trying: the driver may be gone)."""
    if not _send(address, line):
        report.line(line)


def _send(address: str | None, line: str) -> bool:
    sock = _senders.get(address) if address else None
    if address and address not in _senders:
        where, _, token = address.partition("/")
        host, port = where.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            sock.sendall(f"{token}\n".encode())  # the listener hears only its job (see above)
        except OSError:
            sock = None
        _senders[address] = sock
        # A long-lived worker serves job after job, each with its own listener: keep the
        # newest few connections, close the rest (their listeners are gone).
        while len(_senders) > KEEP_SENDERS:
            old = _senders.pop(next(iter(_senders)))
            if old is not None:
                old.close()
    if sock is not None:
        try:
            sock.sendall((line.replace("\n", " ") + "\n").encode())
            return True
        except OSError:
            _senders[address] = None
    return False


def route_to(host: str | None) -> str:
    """This host's address on the route to `host` (no packet is sent: UDP connect): where an
    engine's tasks on that host reach this process (shardline.engines: Engine.listen_address)."""
    if not host or host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
