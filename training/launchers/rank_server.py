"""The process ranks are forked from: a fresh interpreter running this module.

Ranks are not started through multiprocessing, which imports the caller's `__main__` in
every child: a user's script without an `if __name__ == "__main__":` guard would run its
whole body again in each rank, and a script piped to `python -` cannot be imported at all
(`FileNotFoundError: '<stdin>'`). As torchrun starts a fresh interpreter that runs a module,
the launcher starts this one (`python -c BOOT`, with its own interpreter flags and
`sys.path`: training.launchers.rank_process), which imports torch and the training worker
once and then forks one process per rank on request. The caller's main is never imported
anywhere; a rank's function and payload come in a file (training.launchers.rank_call).

Forking instead of starting an interpreter per rank saves each rank the imports, 5-6
CPU-seconds on the 2-core test machine (torch, torch.distributed, DCP, MLflow's SQL store:
measured 5.3 user-s): a job's ranks, a relaunch after a failure and the next job start at
once. Forking is safe here where forking from the launcher would not be: this process has
one thread, no CUDA context and no process group. Python's `random` is reseeded in each
child; nothing in training draws from numpy's or torch's global generators unseeded.

The protocol, on a Unix socket pair made by the launcher (whose end closing ends this
process, and its ranks with it):
- this server says `ready <pid>` once its imports are done;
- a request is a length-prefixed JSON object {"call", "result"} (file paths) sent with three
  file descriptors: a socket of the rank's own, and the launcher's stdout and stderr of
  now, which become the rank's;
- on the rank's socket the server says `pid <pid>` when it has forked it and
  `exit <code>` when it ended (negative: killed by that signal), then closes it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import selectors
import signal
import socket
import struct
import sys

from .guard import die_with_parent
from .rank_call import run_file

# Imported once here; a module that fails to import is skipped. Three are named for what
# they cost each rank that imports them itself (CPU-s, 2-core machine): torch._dynamo,
# ~0.45 s, which torch imports lazily during every strategy's first steps;
# torch.distributed.checkpoint with DTensor, ~0.6 s, which a rank imports at its first
# checkpoint (every strategy writes DCP); MLflow's SQL store, ~0.85 s, which rank 0 imports to
# report to the default (SQLite) tracking store (opening the store after that: ~0.06 s).
# The rest is what a rank of shardline's own loop still imported after its fork (69 modules,
# listed from sys.modules): the loop, the strategies with torch's pipelining and DDP's comm
# hooks, the checkpoint and tracking steps, and what opening the SQLite store imports. Each
# is little, but every rank of every job paid it: a Dask estimator's one-rank fit of a small
# table took 1.55-1.74 s with the short list, 1.08-1.12 s with this one (10 fits each).
PRELOAD = [
    "torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "shardline.training.loop.runner",
    "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store",
    "shardline.training.loop.builtin", "shardline.training.loop.register", "shardline.training.loop.prepare",
    "shardline.training.loop.state", "shardline.training.loop.tracking", "shardline.training.strategies.mesh",
    "shardline.training.checkpoints.sharded", "shardline.training.checkpoints.dcp_storage",
    "shardline.training.evaluate", "shardline.training.launchers.network", "shardline.pipelines.sources",
    "shardline.pipelines.raw", "torch.distributed.checkpoint.state_dict", "torch.distributed.algorithms.ddp_comm_hooks",
    "torch.utils.serialization", "pyarrow.csv", "sqlalchemy.dialects.sqlite", "alembic.command", "alembic.config",
    "mlflow.store.tracking.sqlalchemy_workspace_store",
]  # fmt: skip

HEADER = struct.Struct("!I")  # a request's length, before its JSON
FDS_PER_REQUEST = 3  # the rank's socket, its stdout, its stderr


def main(fd: int) -> None:
    # A terminal's Ctrl-C reaches the whole foreground group: the launcher decides what
    # its ranks do then, this server stays (as multiprocessing's fork server does).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control = socket.socket(fileno=fd)
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    control.sendall(f"ready {os.getpid()}\n".encode())
    _serve(control)


def _serve(control: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of it
    signal.set_wakeup_fd(wake_w)
    ranks: dict[int, socket.socket] = {}  # pid -> the rank's socket
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj is control:
                    request = _receive(control)
                    if request is None:  # the launcher is gone: so are its ranks
                        return
                    _fork(request, ranks, control, (wake_r, wake_w))
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 512)
            _reap(ranks)
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _receive(control: socket.socket) -> tuple[dict, list[int]] | None:
    head, fds, _, _ = socket.recv_fds(control, HEADER.size, FDS_PER_REQUEST)
    if not head:
        return None
    while len(head) < HEADER.size:
        more = control.recv(HEADER.size - len(head))
        if not more:
            return None
        head += more
    (size,) = HEADER.unpack(head)
    body = b""
    while len(body) < size:
        more = control.recv(size - len(body))
        if not more:
            return None
        body += more
    return json.loads(body), fds


def _fork(request: tuple[dict, list[int]], ranks: dict, control: socket.socket, wake: tuple[int, int]) -> None:
    spec, (sock_fd, out, err) = request
    rank_sock = socket.socket(fileno=sock_fd)
    pid = os.fork()
    if pid == 0:  # the rank: never returns into this loop
        code = 70
        try:
            control.close()
            rank_sock.close()
            for fd in wake:
                os.close(fd)
            code = _child(spec, out, err, [s.fileno() for s in ranks.values()])
        finally:
            os._exit(code)
    os.close(out)
    os.close(err)
    ranks[pid] = rank_sock
    _say(rank_sock, f"pid {pid}")


def _child(spec: dict, out: int, err: int, others: list[int]) -> int:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a rank is interrupted as any process
    for fd in others:  # other ranks' sockets: their launcher must see them close with the server
        with contextlib.suppress(OSError):
            os.close(fd)
    # The rank dies with this server, which ends when its launcher does (and its guard ends
    # it when the job's driver or its lease is gone: training.launchers.guard).
    die_with_parent()
    # Each rank its own session, as torchrun starts its workers (start_new_session): under
    # Linux's autogroup scheduling a session shares the CPU as one, so on a busy machine the
    # ranks in the launcher's session got a fraction of what torchrun's got for the same work
    # (`bench train --loop`, load 30-54 on 2 cores: 0.24 of torchrun's steps/s, 0.83 per
    # CPU-second). Idle, it changes nothing. A Ctrl-C reaches the launcher, which ends the
    # ranks; they die with the server anyway (die_with_parent).
    os.setsid()
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    random.seed()
    return run_file(spec["call"], spec["result"])


def _reap(ranks: dict[int, socket.socket]) -> None:
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = ranks.pop(pid, None)
        if sock is not None:
            _say(sock, f"exit {os.waitstatus_to_exitcode(status)}")
            sock.close()


def _say(sock: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):  # the launcher dropped this rank already
        sock.sendall(f"{line}\n".encode())
