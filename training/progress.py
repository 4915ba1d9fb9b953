"""Progress lines from ranks and tasks onto the console that started the job.

A rank on a Spark executor or a Dask worker writes to that process's stderr, which on
a cluster is a log file on another host. The driver therefore listens on a TCP port
(`ProgressListener`), on the address the cluster reaches it at, and ranks send their
lines there (`say`): one mechanism for every launcher (local processes, Spark classic
and Connect, Dask), across hosts that share no disk.

Bounded by design: a rank connects with a short timeout and sends one line at a time;
if the driver cannot be reached (a firewall, a driver gone), the rank prints the line to
its own stderr as before and stops trying, so training never waits on the console.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 2.0
DRAIN_S = 1.0  # how long the driver waits for lines in flight when the job ends


class ProgressListener:
    """A driver-side listener printing every line it receives to this process's stderr."""

    def __init__(self, host: str = "127.0.0.1", out=None):
        self._out = out or sys.stderr
        self._server = socket.create_server((host, 0))
        self._server.settimeout(0.5)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._readers: list[tuple[threading.Thread, socket.socket]] = []
        self._thread = threading.Thread(target=self._accept, name="shardline-progress", daemon=True)

    def __enter__(self) -> ProgressListener:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()
        # Lines still in flight get a moment; then the connections close (a reused Spark
        # Python worker would hold its end open forever; its next line goes to its log).
        deadline = time.monotonic() + DRAIN_S
        for t, conn in self._readers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

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
            for line in lines:
                with self._lock:
                    print(line.rstrip("\n"), file=self._out, flush=True)


_senders: dict[str, socket.socket | None] = {}


def say(address: str | None, line: str) -> None:
    """Send `line` to the driver's listener at `address`; print it here if there is none
    or it cannot be reached (then stop trying: the driver may be gone)."""
    sock = _senders.get(address) if address else None
    if address and address not in _senders:
        host, port = address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            sock = None
        _senders[address] = sock
    if sock is not None:
        try:
            sock.sendall((line.replace("\n", " ") + "\n").encode())
            return
        except OSError:
            _senders[address] = None
    print(line, file=sys.stderr, flush=True)


def listen_address(launcher: str, spark=None, dask_client=None) -> str:
    """The address of this host that the ranks' hosts reach: loopback for local ranks
    and local masters, else the local end of a route toward the cluster."""
    if launcher == "dask" and dask_client is not None:
        return _route_to(urlparse(dask_client.scheduler.address).hostname)
    if launcher == "spark" and spark is not None:
        from pipelines.spark_setup import connect_url, is_connect, spark_master, spark_setting

        if is_connect(spark):  # the ranks run on the Connect server's cluster
            return _route_to(urlparse((connect_url(spark) or "").replace("sc://", "http://")).hostname)
        master = spark_master(spark)
        if master.startswith("local"):
            return "127.0.0.1"
        return spark_setting(spark, "spark.driver.host") or _route_to(urlparse(master.replace("spark://", "http://")).hostname)
    return "127.0.0.1"


def _route_to(host: str | None) -> str:
    """This host's address on the route to `host` (no packet is sent: UDP connect)."""
    if not host or host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
