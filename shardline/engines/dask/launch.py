"""One rank per Dask worker: tasks pinned to worker addresses, each rank a process of its own.

A rank does not run in its worker's process: the task forks it from the worker's rank
server (training.launchers.rank_process) and waits for it. A worker whose rank was killed,
failed or was stopped keeps nothing of it (no process group, no TCPStore, none of their
threads, none of the user's modules) and runs the next job's rank from a clean fork; a
killed rank leaves its worker up, at its address, ready for the relaunch at once.

A launch has two steps, each bounded by `timeout_s` and each failing in one line:
1. every chosen worker's rank server is made ready (it imports torch once per worker: on
   a worker the nanny just restarted, under load, that alone can take minutes), and rank
   0's worker picks the rendezvous port;
2. the ranks start together, so the rendezvous waits only for processes that are forked
   at once, never for a worker still importing.
When a rank fails, the launcher waits a moment for its peers' own errors, then stops the
job's other ranks (their worker threads are free for the relaunch) and says one line,
the lost rank first.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from typing import Any

from shardline.foundation.code_travel import UserCode, locate, ship_to_dask
from shardline.foundation.dask_wait import interruptible_wait
from shardline.foundation.errors import ShardlineError

from shardline.training.launchers import LOST_PEER_GRACE_S, DriverGuard, RankFn, TrainingFailed, announced, free_port
from shardline.training.launchers.rank_call import RankCall, pickled_call, setup_here, write_call
from shardline.training.launchers.rank_errors import RankError, exit_reason, lost_rank, rank_failures
from shardline.training.launchers.rank_process import RankProcess, rank_server
from shardline.training.placement import Slot, host_of, own_visible_gpus, slots

_KEY = "shardline-rank-"
# The rank processes this worker runs, by their task's key: the launcher stops them by it.
_RUNNING: dict[str, RankProcess] = {}
_STOPPED: dict[str, None] = {}  # launches whose ranks were stopped (ordered: oldest first)
_RUNNING_LOCK = threading.Lock()


class RankLost(Exception):
    """A rank's process ended without a word (killed): the line naming it, from its worker."""


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
    chosen = _choose(client, world_size, wait_s, workers)
    launch = f"{_KEY}{uuid.uuid4().hex[:12]}"
    init_method, placed = _ready(client, chosen, launch, timeout_s)
    futures = [
        client.submit(
            _rank_task, pickled_call(RankCall(fn, rank, world_size, init_method, payload, timeout_s, guard,
                                              slot=placed[rank])),
            rank, code, addr, workers=[addr], allow_other_workers=False, pure=False, key=f"{launch}-{rank}",
        )
        for rank, addr in enumerate(chosen)
    ]
    try:
        # A worker that leaves takes its rank along without an error: its task, pinned there,
        # never ends. The launch fails then, without waiting for a survivor to notice.
        interruptible_wait(futures, stop_at_error=True, give_up=lambda: _any_gone(client, chosen))
    except KeyboardInterrupt:
        # Ctrl-C: a running Dask task cannot be cancelled, so its rank process is ended by the
        # worker; any rank this misses stops within a second, told through the checkpoint
        # folder (guard.DriverGuard.stop). Nothing waits on the futures: no gather is left
        # behind to report their cancellation.
        if guard is not None:
            guard.stop()
        _stop_ranks(client, chosen, launch, futures)
        raise
    if all(f.status == "finished" for f in futures):
        return client.gather(futures)
    raise _failure(client, futures, chosen, launch, getattr(payload, "ranks_dir", None))


def workers_missing(have: int, need: int, waited_s: float) -> TrainingFailed:
    """A relaunch whose lost worker did not come back: the job ends (permanent)."""
    return TrainingFailed(f"Dask training failed: {have} of the {need} Dask workers it needs are up after "
                          f"waiting {waited_s:.0f} s for a lost one to come back", permanent=True)


def _any_gone(client, chosen: list[str]) -> bool:
    try:
        return not set(chosen) <= set(client.scheduler_info()["workers"])
    except Exception:  # noqa: BLE001 - the scheduler did not answer: ask again later
        return False


def _choose(client, world_size: int, wait_s: float, workers: list[str] | None) -> list[str]:
    if wait_s:
        try:
            client.wait_for_workers(world_size, timeout=wait_s)
        except Exception:  # still too few after wait_s: the cluster lost capacity, trying again waits as long
            raise workers_missing(len(client.scheduler_info()["workers"]), world_size, wait_s) from None
    live = check_dask_workers(client, world_size)
    chosen = [w for w in workers or [] if w in live][:world_size]
    if len(chosen) < world_size:
        # None given, or one is gone (a nanny restarts a killed worker under a new address):
        # a task pinned to a gone worker would wait forever.
        chosen = live[:world_size]
    return chosen


def _ready(client, chosen: list[str], launch: str, timeout_s: float) -> tuple[str, list[Slot]]:
    """Every chosen worker's rank server ready, and rank 0's worker's rendezvous address;
    each rank's slot: its host from its worker's address, and device 0 for a worker whose
    CUDA_VISIBLE_DEVICES lists a GPU of its own first (dask-cuda: each worker sees its own
    GPU as device 0; by local rank, two ranks would share one)."""
    futures = [client.submit(_ready_task, rank == 0, timeout_s, workers=[addr], allow_other_workers=False,
                             pure=False, key=f"{launch}-ready-{rank}")
               for rank, addr in enumerate(chosen)]
    deadline = time.monotonic() + timeout_s + 30  # the task's own bound, and a margin to say it
    try:
        interruptible_wait(futures, stop_at_error=True, deadline=deadline)
    except KeyboardInterrupt:
        client.cancel(futures)
        raise
    if not all(f.status == "finished" for f in futures):
        waiting = [addr for f, addr in zip(futures, chosen) if f.status != "finished"]
        client.cancel(futures)
        live = set(client.scheduler_info()["workers"])
        gone = [a for a in waiting if a not in live]
        why = (f"Dask worker {', '.join(gone)} left the cluster as the ranks started" if gone else
               f"the ranks' processes on Dask worker {', '.join(waiting)} were not ready within "
               f"{timeout_s:.0f} s (training.timeout_s)")
        raise TrainingFailed(f"Dask training failed: {why}")
    said = client.gather(futures)
    hosts = [host_of(a) for a in chosen]
    own = own_visible_gpus(hosts, [s["visible"] for s in said])
    return said[0]["init_method"], slots(hosts, own, "its Dask worker's CUDA_VISIBLE_DEVICES (dask-cuda)")


def _ready_task(rendezvous: bool, timeout_s: float) -> dict:
    """On a worker: its rank server ready; rank 0's picks the port where the store will bind it."""
    from distributed import get_worker

    if not rank_server().wait_ready(timeout_s):
        raise TimeoutError(f"the rank server was not ready within {timeout_s:.0f} s")
    host = host_of(get_worker().address)
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "init_method": f"tcp://{host}:{free_port(host)}" if rendezvous else None}


def _rank_task(call: bytes, rank: int, code: UserCode | None, address: str) -> Any:
    """On a worker: fork the rank's process, wait for it, return its result or raise its error.

    The worker's own "Compute Failed" report of a failed rank (a dozen lines on its log, the
    console for a LocalCluster) is dropped: the driver says it in one line, and the
    traceback of a bug is in the rank's log file (launchers.rank_errors)."""
    from distributed import get_worker

    worker_log = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _RankReports) for f in worker_log.filters):
        worker_log.addFilter(_RankReports())
    key = str(get_worker().get_current_task())
    try:
        code = locate(code)  # the user's zip where this worker keeps it
    except ShardlineError as e:  # it did not reach this worker: permanent, as in the rank
        raise RankError.of(rank, e) from None
    with tempfile.TemporaryDirectory(prefix="shardline-rank-") as folder:
        call_path, result_path = os.path.join(folder, "call"), os.path.join(folder, "result")
        # The worker's environment and path of now (a worker's CUDA_VISIBLE_DEVICES, its
        # shipped zips).
        write_call(call_path, call, code, setup_here())
        proc = rank_server().start(call_path, result_path)
        with _RUNNING_LOCK:
            _RUNNING[key] = proc
            stopped = any(key.startswith(prefix) for prefix in _STOPPED)
        if stopped:  # the launcher stopped this launch before its process existed
            proc.kill()
        try:
            returncode = proc.wait()
        finally:
            with _RUNNING_LOCK:
                _RUNNING.pop(key, None)
        outcome = proc.outcome()
    if outcome and outcome[0] == "ok":
        return outcome[1]
    if outcome:
        raise RankError(outcome[1])
    raise RankLost(lost_rank(rank, host_of(address), exit_reason(returncode), proc.pid, f"worker {address}"))


class _RankReports(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Compute Failed") and _KEY in str(record.args)[:200])


def _kill_ranks(prefix: str) -> list[str]:
    """On a worker: end its rank processes of launch `prefix`, and any it starts later (a
    task that had not yet started its process); their task keys."""
    with _RUNNING_LOCK:
        _STOPPED[prefix] = None
        while len(_STOPPED) > 64:  # launches long over
            _STOPPED.pop(next(iter(_STOPPED)))
        mine = {k: p for k, p in _RUNNING.items() if str(k).startswith(prefix)}
    for proc in mine.values():
        proc.kill()
    return list(mine)


def _stop_ranks(client, chosen: list[str], launch: str, futures: list, within_s: float = 30) -> None:
    """End this launch's rank processes still running, and wait (bounded) for their tasks to
    end: a relaunch's ranks then find their workers' threads free. Never raises: it runs
    on the way out of a failure or a Ctrl-C."""
    try:
        live = set(client.scheduler_info()["workers"])
        here = [a for a in chosen if a in live]
        client.run(_kill_ranks, f"{launch}-", workers=here, on_error="ignore")
        # A task pinned to a worker that left never ends: only the others are waited for.
        interruptible_wait([f for f, a in zip(futures, chosen) if a in live], stop_at_error=False,
                           deadline=time.monotonic() + within_s)
    except Exception:  # noqa: BLE001 - the scheduler or a worker is gone: its ranks went with it
        pass
    client.cancel(futures)


def _failure(client, futures, chosen: list[str], launch: str, ranks_dir: str | None) -> TrainingFailed:
    """The launch's one line, once a rank failed: its peers get a moment to fail with their
    own errors (a bug on every rank is said once, "rank 1 the same"), then the rest stop."""
    interruptible_wait(futures, stop_at_error=False, deadline=time.monotonic() + LOST_PEER_GRACE_S + 1)
    errors = [f.exception() for f in futures if f.status == "error"]
    lost = [str(e) for e in errors if isinstance(e, RankLost)]
    text = "; ".join(str(e) for e in errors if not isinstance(e, RankLost))
    if not lost and not any(f["permanent"] for f in rank_failures(text)):
        # No rank's process was seen to die: a survivor's "connection closed" when a peer's
        # whole worker died. The rank whose worker left the cluster leads the line.
        lost = _lost_workers(client, futures, chosen, ranks_dir)
    _stop_ranks(client, chosen, launch, futures)
    first = errors[0] if errors else None
    fallback = f"{type(first).__name__}: {first}" if first is not None else "no result"
    return TrainingFailed.from_ranks("Dask", text, fallback, lost)


def _lost_workers(client, futures, chosen: list[str], ranks_dir: str | None, within_s: float = 5.0) -> list[str]:
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
