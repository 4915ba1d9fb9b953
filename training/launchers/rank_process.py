"""A rank in a process of its own, forked by this process's rank server.

The launchers' side of training.launchers.rank_server: `rank_server()` is the one server
of this process (the local launcher's driver, or a Dask worker), started on first use and
again if it died; `RankServer.start` forks a rank that runs a call file
(training.launchers.rank_call) and returns a `RankProcess`: its pid, its exit code when it
ends (negative: the signal that killed it), its outcome from the result file.

A rank never lives in the launcher's own process, so nothing a rank leaves behind (a
process group, a TCPStore, their threads, a half-imported module of the user's) outlives
it: a Dask worker whose rank failed runs the next job's rank from a clean fork.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from .rank_call import import_path, read_result
from .rank_server import FDS_PER_REQUEST, HEADER

# The server's first lines: its sys.path is the launcher's (a test's modules, a Dask
# worker's shipped zip), given before `shardline` itself is imported from it.
BOOT = ("import json, os, sys; sys.path[:] = json.loads(os.environ.pop('SHARDLINE_RANK_SERVER_PATH')); "
        "from shardline.training.launchers.rank_server import main; main(int(sys.argv[1]))")


class RankServerGone(RuntimeError):
    """The rank server exited (killed, or it could not start): its ranks ended with it."""


class _Lines:
    """Lines read from a socket, with an optional wait; b"" at its end."""

    def __init__(self, sock: socket.socket):
        self.sock, self._buf, self.closed = sock, b"", False

    def next(self, timeout: float | None) -> str | None:
        """The next line; None if none came within `timeout`; "" once the socket closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf and not self.closed:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.sock.settimeout(left)
            try:
                more = self.sock.recv(256)
            except (TimeoutError, BlockingIOError):
                return None
            except OSError:
                more = b""
            if not more:
                self.closed = True
            self._buf += more
        if b"\n" not in self._buf:
            return ""
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()


class RankProcess:
    """One rank's process: `poll`/`wait` for its exit code, `kill`, `outcome`."""

    def __init__(self, lines: _Lines, pid: int, result_path: str):
        self._lines, self.pid, self.result_path = lines, pid, result_path
        self.returncode: int | None = None

    def fileno(self) -> int:  # select() on it: readable when the rank has ended
        return self._lines.sock.fileno()

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code once it ended (negative: the signal), else None after `timeout`."""
        if self.returncode is None:
            line = self._lines.next(timeout)
            if line is not None:
                # "": the server died without a word, and its ranks with it (their parent-death
                # signal is SIGKILL): the rank was killed, and that is what is said.
                self.returncode = int(line.split()[1]) if line.startswith("exit ") else -signal.SIGKILL
                self._lines.sock.close()
        return self.returncode

    def poll(self) -> int | None:
        return self.wait(0)

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def outcome(self) -> tuple[str, Any] | None:
        """("ok", result) or ("error", its RankError text); None when it wrote none (killed)."""
        return read_result(self.result_path)


class RankServer:
    """A rank server started by this process (training.launchers.rank_server): a fresh
    interpreter with this one's flags and sys.path (less a model's copy of shardline:
    rank_call.import_path), its stdout and stderr this process's of now."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "SHARDLINE_RANK_SERVER_PATH": json.dumps(import_path())}
        # The interpreter's own flags (-S on a Dask CLI worker that runs without site-packages'
        # .pth files, -X options): the ones multiprocessing passes its spawned children.
        flags = subprocess._args_from_interpreter_flags()
        self._proc = subprocess.Popen([sys.executable, *flags, "-c", BOOT, str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._control = _Lines(ours)
        self._lock = threading.Lock()
        self.pid: int | None = None  # set once it is ready

    def alive(self) -> bool:
        return self._proc.poll() is None and not self._control.closed

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Until the server has imported torch and the worker; False after `timeout`."""
        with self._lock:
            if self.pid is None:
                line = self._control.next(timeout)
                if line is None:
                    return False
                if not line.startswith("ready "):
                    raise RankServerGone(f"the rank server exited as it started (exit code {self._proc.wait()})")
                self.pid = int(line.split()[1])
        return True

    def start(self, call_path: str, result_path: str, stdio: tuple[int, int] = (1, 2)) -> RankProcess:
        """Fork a rank that runs `call_path` and writes `result_path`; its output goes to
        `stdio` (this process's stdout and stderr as they are now, by default)."""
        self.wait_ready()
        mine, theirs = socket.socketpair()
        body = json.dumps({"call": call_path, "result": result_path}).encode()
        message = HEADER.pack(len(body)) + body
        fds = [theirs.fileno(), *stdio]
        assert len(fds) == FDS_PER_REQUEST
        try:
            with self._lock:
                sent = socket.send_fds(self._control.sock, [message], fds)
                self._control.sock.sendall(message[sent:])
        except OSError as e:
            mine.close()
            raise RankServerGone(f"the rank server is gone ({e})") from e
        finally:
            theirs.close()
        lines = _Lines(mine)
        said = lines.next(None)
        if not said or not said.startswith("pid "):
            raise RankServerGone("the rank server exited before it started the rank")
        return RankProcess(lines, int(said.split()[1]), result_path)

    def stop(self) -> None:
        self._control.sock.close()  # its end closing ends it, and its ranks with it
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)


_SERVER: RankServer | None = None
_LOCK = threading.Lock()


def rank_server() -> RankServer:
    """This process's rank server, started now if there is none (or it died)."""
    global _SERVER
    with _LOCK:
        if _SERVER is None or not _SERVER.alive():
            _SERVER = RankServer()
        return _SERVER
