"""One rank per Dask worker: tasks pinned to worker addresses, port picked on rank 0's host."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from shardline.foundation.code_travel import UserCode, ship_to_dask
from shardline.foundation.errors import ShardlineError

from ..placement import Slot, host_of, own_visible_gpus, slots
from . import DriverGuard, RankFn, TrainingFailed, announced, free_port, run_in_group
from .rank_errors import lost_rank, rank_failures


def _rendezvous_address() -> str:
    # Runs on rank 0's worker: the port must be free where the store will bind it.
    from distributed import get_worker

    host = host_of(get_worker().address)
    return f"tcp://{host}:{free_port(host)}"


def _visible_devices() -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def dask_slots(client, chosen: list[str]) -> list[Slot]:
    """Each rank's slot: its host from its worker's address, and device 0 for a worker
    whose CUDA_VISIBLE_DEVICES lists a GPU of its own first (dask-cuda: each worker sees
    its own GPU as device 0; by local rank, two ranks would share one)."""
    try:
        visible = client.run(_visible_devices, workers=chosen)
    except Exception as e:  # a worker lost since it was chosen: a relaunch picks others
        raise TrainingFailed(f"Dask training failed: {type(e).__name__}: {e}") from e
    hosts = [host_of(a) for a in chosen]
    own = own_visible_gpus(hosts, [visible.get(a) for a in chosen])
    return slots(hosts, own, "its Dask worker's CUDA_VISIBLE_DEVICES (dask-cuda)")


def check_dask_workers(client, world_size: int) -> list[str]:
    workers = sorted(client.scheduler_info()["workers"])
    if world_size > len(workers):
        raise ShardlineError(
            f"training.world_size {world_size} is greater than the {len(workers)} Dask workers "
            f"of {client.scheduler.address}"
        )
    return workers


def launch_dask(
    client,
    fn: RankFn,
    payload: Any,
    world_size: int,
    timeout_s: float = 300,
    wait_s: float = 0,
    workers: list[str] | None = None,
    guard: DriverGuard | None = None,
    code: UserCode | None = None,
) -> list[Any]:
    """Run `fn` on `world_size` Dask workers, one rank each; return the results by rank.

    wait_s: how long to wait for enough workers (a relaunch after a killed worker
    waits for its nanny to bring a new one up, under a new address). workers: the
    workers to use (a sweep gives each concurrent trial its own); default the first ones.
    code: the job's snapshot of the user's code (foundation.code_travel), uploaded to the
    workers and made current in each rank before `fn` runs.
    """
    ship_to_dask(client, code)
    if wait_s:
        try:
            client.wait_for_workers(world_size, timeout=wait_s)
        except Exception:
            pass  # still too few: refused just below with a clear message
    live = check_dask_workers(client, world_size)
    chosen = [w for w in workers or [] if w in live][:world_size]
    if len(chosen) < world_size:
        # None given, or one is gone (a nanny restarts a killed worker under a new
        # address): a task pinned to a gone worker would wait forever.
        chosen = live[:world_size]
    placed = dask_slots(client, chosen)
    init = client.submit(_rendezvous_address, workers=[chosen[0]], allow_other_workers=False, pure=False)
    init_method = init.result()
    futures = [
        client.submit(
            _rank, fn, rank, world_size, init_method, payload, timeout_s, guard, slot=placed[rank],
            code=code,
            workers=[addr], allow_other_workers=False, pure=False, key=f"{_KEY}{rank}-{init.key}",
        )
        for rank, addr in enumerate(chosen)
    ]
    try:
        return client.gather(futures)
    except KeyboardInterrupt:
        # Ctrl-C: a running Dask task cannot be cancelled, so the ranks are told through the
        # checkpoint folder (guard.DriverGuard.stop) and end within a second.
        if guard is not None:
            guard.stop()
        for f in futures:
            f.cancel()
        raise
    except Exception as e:
        raise _failed(client, futures, chosen, getattr(payload, "ranks_dir", None), e) from e


def _failed(client, futures, chosen: list[str], ranks_dir: str | None, e: Exception) -> TrainingFailed:
    """The job's one line from the first failed rank's error `e` (a survivor's "connection
    closed", when a peer's worker died: the rank whose worker left the cluster leads the
    line; a rank's own bug: its peers' errors beside it)."""
    bug = any(f["permanent"] for f in rank_failures(str(e)))
    lost = [] if bug else _lost_ranks(client, futures, chosen, ranks_dir)
    text = "; ".join([str(e), *_peers_errors(futures)]) if bug else str(e)
    for f in futures:
        f.cancel()
    return TrainingFailed.from_ranks("Dask", text, f"{type(e).__name__}: {e}", lost, ranks_dir=ranks_dir)


_KEY = "shardline-rank-"
PEERS_WAIT_S = 30.0


def _peers_errors(futures) -> list[str]:
    """The other ranks' errors, when one rank's own error ended the job: gather hands over
    the first, and a running Dask task is not stopped, so its peers, running the same code
    on the same kind of batch, end in a moment too, failing alike or losing it (a lost
    peer's rank waits LOST_PEER_GRACE_S first): PEERS_WAIT_S at most. Their markers let the
    line say "rank 0 the same"."""
    from distributed import wait

    with contextlib.suppress(Exception):  # the line is said without them
        wait(futures, timeout=PEERS_WAIT_S)
    return [str(f.exception()) for f in futures if f.status == "error"]


def _rank(*args, **kwargs):
    """run_in_group on a Dask worker, whose own "Compute Failed" report of a failed rank (a
    dozen lines on its log, the console for a LocalCluster) is dropped: the driver says it in
    one line, and the traceback of a bug is in the rank's log file (launchers.rank_errors)."""
    worker_log = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _RankReports) for f in worker_log.filters):
        worker_log.addFilter(_RankReports())
    return run_in_group(*args, **kwargs)


class _RankReports(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Compute Failed") and _KEY in str(record.args)[:200])


def _lost_ranks(client, futures, chosen: list[str], ranks_dir: str | None, within_s: float = 5.0) -> list[str]:
    """The ranks whose worker left the cluster while they ran (killed, its host lost): the
    scheduler drops a worker at once when its connection closes, but waiting a moment
    covers a heartbeat's delay. Named with the host and pid they announced (ranks/rank-N.json)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            live = set(client.scheduler_info()["workers"])
        except Exception:  # the scheduler itself is gone: nothing to tell the ranks apart
            return []
        gone = [r for r, (f, addr) in enumerate(zip(futures, chosen))
                if addr not in live and f.status not in ("finished", "error")]
        if gone or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    lines = []
    for r in gone:
        said = announced(ranks_dir, r) or {}
        lines.append(lost_rank(r, said.get("host") or host_of(chosen[r]), "its Dask worker left the cluster",
                               said.get("pid"), f"worker {chosen[r]}"))
    return lines
