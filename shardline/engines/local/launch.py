"""N processes on this machine: the embedded default launcher.

Ranks are forked from a fork server (multiprocessing's "forkserver") that imported
torch and the training worker once, instead of spawned as fresh interpreters that
each import them again (2-4 CPU-seconds a rank): a job's ranks, a relaunch after a
failure and the next job start at once. Forking from the server is safe where
forking from the launcher would not be: the server is a process of its own with no
threads, no CUDA context and no process group. Python's `random` is reseeded in each
child; nothing in training draws from numpy's or torch's global generators unseeded.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
from typing import Any

from shardline.foundation.code_travel import UserCode

from shardline.training.launchers import (
    LOST_PEER_GRACE_S,
    DriverGuard,
    RankFn,
    TrainingFailed,
    available_cores,
    free_port,
    run_in_group,
)
from shardline.training.launchers.guard import die_with_parent
from shardline.training.launchers.rank_errors import exit_reason, lost_rank

# Imported once by the fork server; a module that fails to import is skipped there. Three are
# named for what they cost each rank that imports them itself (CPU-s, 2-core machine):
# torch._dynamo, ~0.45 s, which torch imports lazily during every strategy's first steps;
# torch.distributed.checkpoint with DTensor, ~0.6 s, which a rank imports at its first
# checkpoint (every strategy writes DCP); MLflow's SQL store, ~0.85 s, which rank 0 imports to
# report to the default (SQLite) tracking store (opening the store after that: ~0.06 s).
PRELOAD = [
    "torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "shardline.training.loop.runner",
    "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store",
]  # fmt: skip

# Once a rank has failed, the others get this long to end on their own before the launcher
# kills them, as torchrun's agent does: the restart never waits on a survivor stuck in a wait.
# A survivor that saw the lost peer reports it at once: this launcher hears every rank's
# error and exit code, so none need hold back for a peer's to come first (Spark and Dask
# report only the first; their ranks wait LOST_PEER_GRACE_S).
FAILED_RANK_GRACE_S = 3 * LOST_PEER_GRACE_S


def process_context():
    """Where new processes come from: the fork server (torch already imported), or spawn."""
    if "forkserver" not in mp.get_all_start_methods():  # not on Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    return ctx


class _LauncherStdio:
    """The launcher's stdout and stderr as they are at launch, handed to a rank as file
    descriptors: the server's own are those of its start (an earlier capture, a closed
    terminal), while a spawned rank would inherit the launcher's current ones."""

    def __reduce__(self):
        from multiprocessing import reduction

        # DupFd works only while the Process is being pickled for its launch: here.
        return _attach_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _attach_stdio(out, err) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for wrapper, target in ((out, 1), (err, 2)):
        fd = wrapper.detach()
        os.dup2(fd, target)
        os.close(fd)


def _rank_main(fn, rank, world_size, init_method, payload, timeout_s, results, env, cwd, stdio, guard,
               code=None):
    # A rank dies with its parent (the fork server, which exits with the launcher), and
    # its guard ends it when the launcher's process or its lease is gone.
    die_with_parent()
    # Each rank its own session, as torchrun starts its workers (start_new_session): under
    # Linux's autogroup scheduling a session shares the CPU as one, so on a busy machine the
    # ranks in the launcher's session got a fraction of what torchrun's got for the same work
    # (`bench train --loop`, load 30-54 on 2 cores: 0.24 of torchrun's steps/s, 0.83 per
    # CPU-second). Idle, it changes nothing. A Ctrl-C reaches the launcher alone, which ends
    # the ranks (launch_local); they die with it anyway (die_with_parent).
    os.setsid()
    # The server kept the environment and folder of its own start; a rank gets the
    # launcher's of now, as a spawned process would (e.g. GLOO_SOCKET_IFNAME). Its
    # stdout and stderr were re-attached when `stdio` was unpickled.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # A rank that native code kills (SIGSEGV in torch, gloo or a library) prints its threads'
    # Python stacks first, on the launcher's stderr: the launcher alone sees only "exit code -11".
    faulthandler.enable()
    # torch starts one intra-op thread per core in every process, so world_size ranks on one
    # machine would run world_size x cores threads, and OpenMP's threads spin while they wait
    # for each other's cores. Measured on 2 cores (tests/test_equivalence.py): 4 ranks of
    # DTensor dp x tp training took 19.4 s with torch's default and 4.4 s with this, 2 ranks
    # of tensor parallel 6.2 s and 1.8 s. torchrun sets OMP_NUM_THREADS=1 for the same
    # reason; Spark's Python workers get OMP_NUM_THREADS = spark.task.cpus (seen: 1) and
    # Dask's nannies 1. A rank function may set its own (run_rank: training.threads_per_rank).
    _torch_threads(world_size)
    try:
        result = run_in_group(fn, rank, world_size, init_method, payload, timeout_s, guard,
                              lost_peer_grace_s=0, code=code)
        # Plain pickle bytes: a queue would pass tensors as shared memory that dies
        # with this process before the parent reads it.
        results.put((rank, pickle.dumps(result), None))
    except BaseException as e:  # report, then fail the process
        # A RankError: its marker says rank, host and cause (a bug's traceback is in its log file).
        results.put((rank, None, str(e) or repr(e)))
        raise SystemExit(1) from None


def _torch_threads(world_size: int) -> None:
    """This machine's cores shared among the ranks, at least one thread each; or the
    launcher's OMP_NUM_THREADS if it has one (torchrun, too, keeps a value it is given).
    Set here, not left to torch: torch read the fork server's environment, of its start."""
    import torch  # the fork server's, already imported

    given = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(given) if given.isdigit() and int(given) > 0
                          else max(1, available_cores() // world_size))


def launch_local(
    fn: RankFn, payload: Any, world_size: int, timeout_s: float = 300, guard: DriverGuard | None = None,
    code: UserCode | None = None,
) -> list[Any]:
    """Run `fn` on `world_size` processes of this machine; return the results by rank.

    code: the job's snapshot of the user's code (foundation.code_travel): its zip first on
    each rank's path, so the ranks import the very bytes the driver checked, whatever the
    folders hold by the time a rank (or a restart) starts.
    """
    ctx = process_context()
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, init_method, payload, timeout_s, results, env, cwd,
                  _LauncherStdio(), guard, code),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _wait(procs, results, world_size)
    except KeyboardInterrupt:
        # Ctrl-C: the ranks stop now, and any rank this misses (another host's view of the
        # folder) stops before it commits a checkpoint (guard.DriverGuard.stop).
        if guard is not None:
            guard.stop()
        for p in procs:
            p.kill()
        for p in procs:
            p.join(timeout=30)
        raise


def _wait(procs, results, world_size: int) -> list[Any]:
    """The ranks' results by rank, or TrainingFailed naming the rank that failed or was lost."""
    got, errors = {}, {}
    failed_at = None  # when a rank first failed: from then on the others have a grace to end
    # Drain before join: a process with a large result in the queue cannot exit first.
    while len(got) + len(errors) < world_size:
        try:
            rank, result, err = results.get(timeout=1)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
        else:
            if err:
                errors[rank] = err
            else:
                got[rank] = pickle.loads(result)
        if failed_at is None and (errors or any(p.exitcode for p in procs)):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S:
            break
    stopped = []
    for r, p in enumerate(procs):
        if failed_at is not None and p.is_alive() and r not in got.keys() | errors.keys():
            # A survivor still waiting on the failed rank: a wait that does not notice a dead
            # peer (a store key, a hung device) would hold the restart for training.timeout_s.
            p.kill()
            stopped.append(r)
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if errors or len(got) < world_size:
        # A rank that could not say why (killed) was lost: it leads the line, before its peers'
        # "connection closed" (launchers.rank_errors). Every rank runs on this host.
        lost = [lost_rank(r, socket.gethostname(), exit_reason(p.exitcode), p.pid) for r, p in enumerate(procs)
                if p.exitcode and r not in got.keys() | errors.keys() | set(stopped)]
        text = "; ".join(f"rank {r}: {e}" for r, e in errors.items())
        raise TrainingFailed.from_ranks("local", text, "no result", lost,
                                        [f"rank {r} stopped by the launcher" for r in stopped])
    return [got[r] for r in range(world_size)]
