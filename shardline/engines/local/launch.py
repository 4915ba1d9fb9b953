"""N processes on this machine: the embedded default launcher.

Each rank is a process forked by this process's rank server (training.launchers.rank_server:
a fresh interpreter running a shardline module, which imported torch and the training worker
once), as torchrun starts its ranks: the caller's `__main__` is never imported, so a script
without an `if __name__ == "__main__":` guard, or one piped to `python -`, trains like any
other. A rank's function and payload travel in a file (cloudpickle: a function defined in
the caller's script travels by value), its result comes back in one
(training.launchers.rank_call). A job's ranks, a relaunch after a failure and the next job
start at once: the imports were paid when the server started.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import tempfile
import time
from typing import Any

from shardline.foundation.code_travel import UserCode

from shardline.training.launchers import LOST_PEER_GRACE_S, DriverGuard, RankFn, TrainingFailed, free_port
from shardline.training.launchers.rank_call import RankCall, write_call
from shardline.training.launchers.rank_errors import exit_reason, lost_rank
from shardline.training.launchers.rank_process import RankProcess, rank_server

# Once a rank has failed, the others get this long to end on their own before the launcher
# kills them, as torchrun's agent does: the restart never waits on a survivor stuck in a wait.
# A survivor that saw the lost peer reports it at once: this launcher hears every rank's
# error and exit code, so none need hold back for a peer's to come first (Spark and Dask
# report only the first; their ranks wait LOST_PEER_GRACE_S).
FAILED_RANK_GRACE_S = 3 * LOST_PEER_GRACE_S


def launch_local(
    fn: RankFn, payload: Any, world_size: int, timeout_s: float = 300, guard: DriverGuard | None = None,
    code: UserCode | None = None,
) -> list[Any]:
    """Run `fn` on `world_size` processes of this machine; return the results by rank.

    code: the job's snapshot of the user's code (foundation.code_travel): its zip first on
    each rank's path, so the ranks import the very bytes the driver checked, whatever the
    folders hold by the time a rank (or a restart) starts.
    """
    init_method = f"tcp://127.0.0.1:{free_port()}"
    folder = tempfile.mkdtemp(prefix="shardline-ranks-")  # the calls and results, this launch's
    procs: list[RankProcess] = []
    try:
        server = rank_server()
        for r in range(world_size):
            call = os.path.join(folder, f"rank-{r}.call")
            write_call(call, RankCall(fn, r, world_size, init_method, payload, timeout_s, guard,
                                      lost_peer_grace_s=0, share_cores=True), code)
            procs.append(server.start(call, os.path.join(folder, f"rank-{r}.result")))
        return _wait(procs, world_size)
    except KeyboardInterrupt:
        # Ctrl-C: the ranks stop now, and any rank this misses (another host's view of the
        # folder) stops before it commits a checkpoint (guard.DriverGuard.stop).
        if guard is not None:
            guard.stop()
        raise
    finally:
        for p in procs:  # none outlives its launch (all have ended unless interrupted)
            p.kill()
        for p in procs:
            p.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def _wait(procs: list[RankProcess], world_size: int) -> list[Any]:
    """The ranks' results by rank, or TrainingFailed naming the rank that failed or was lost."""
    got, errors = {}, {}
    failed_at = None  # when a rank first failed: from then on the others have a grace to end
    while any(p.returncode is None for p in procs):
        running = [p for p in procs if p.returncode is None]
        select.select(running, [], [], 1.0)  # a rank's socket is readable once it has ended
        for r, p in enumerate(procs):
            if p.returncode is None and p.poll() is not None:
                outcome = p.outcome()
                if outcome and outcome[0] == "ok":
                    got[r] = outcome[1]
                elif outcome:
                    errors[r] = outcome[1]
        if failed_at is None and (errors or any(p.returncode for p in procs)):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S:
            break
    stopped = []
    for r, p in enumerate(procs):
        if p.returncode is None:
            # A survivor still waiting on the failed rank: a wait that does not notice a dead
            # peer (a store key, a hung device) would hold the restart for training.timeout_s.
            p.kill()
            p.wait(timeout=30)
            stopped.append(r)
    if errors or len(got) < world_size:
        # A rank that could not say why (killed) was lost: it leads the line, before its peers'
        # "connection closed" (launchers.rank_errors). Every rank runs on this host.
        lost = [lost_rank(r, socket.gethostname(), exit_reason(p.returncode), p.pid) for r, p in enumerate(procs)
                if p.returncode and r not in got.keys() | errors.keys() | set(stopped)]
        text = "; ".join(f"rank {r}: {e}" for r, e in errors.items())
        raise TrainingFailed.from_ranks("local", text, "no result", lost,
                                        [f"rank {r} stopped by the launcher" for r in stopped])
    return [got[r] for r in range(world_size)]
