"""Launchers: agree on rank, world size and a rendezvous address, then call one rank function.

A rank function is `fn(rank, world_size, payload) -> result`, called inside an
initialised process group; `run_rank` (training.loop.runner) is the one jobs use.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from shardline.foundation import storage
from shardline.foundation.code_travel import UserCode, use_code
from shardline.foundation.errors import ShardlineError

from ..placement import Slot
from .guard import DriverGuard
from .rank_errors import RankError, is_permanent

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs);
# training.collectives (imports torch); training.launchers.network (a cycle: it imports this module);
# training.launchers.rank_errors (a cycle: it imports this module).

LOST_PEER_GRACE_S = 5.0


def available_cores() -> int:
    """Cores this process may run on (a container's or taskset's limit, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

RankFn = Callable[[int, int, Any], Any]


class TrainingFailed(ShardlineError):
    """A rank failed; the message carries the rank's own error line.

    permanent: a relaunch would fail the same way (a permission error, a full disk,
    bad data or config: training.launchers.guard), so the job ends at once.
    """

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent

    def __reduce__(self):
        return type(self), (str(self), self.permanent)

    @classmethod
    def from_ranks(cls, launcher: str, text: str, fallback: str, lost: list[str] = (),
                   after: list[str] = (), ranks_dir: str | None = None) -> TrainingFailed:
        """From the rank markers found in an error's text (rank_errors.RankError) and the
        ranks the launcher saw lost (rank_errors.lost_rank: they lead, unless a rank's own
        permanent error is the cause), else `fallback`; `after`: notes said last.
        ranks_dir: where the ranks' logs are, for the peers that failed alike but were not
        heard (rank_errors.alike_in_logs)."""
        from .rank_errors import alike_in_logs, describe_failures, rank_failures

        failures = rank_failures(text)
        failures += alike_in_logs(ranks_dir, failures)
        said = describe_failures(failures, list(lost)) if failures or lost else fallback
        return cls(f"{launcher} training failed: {'; '.join([said, *after])}",
                   any(f["permanent"] for f in failures))


def announced_hosts(ranks_dir: str, world_size: int) -> list[str] | None:
    """Each rank's host as it reported it this run (`announced`); None if any did not."""
    infos = [announced(ranks_dir, r) for r in range(world_size)]
    return None if any(i is None for i in infos) else [str(i.get("host")) for i in infos]


def announced(ranks_dir: str | None, rank: int) -> dict | None:
    """What rank `rank` wrote about itself when this attempt started (ranks/rank-N.json: its
    host and pid, training.loop.runner), if it got that far: a lost rank's launcher names it so."""
    if not ranks_dir:
        return None
    try:
        info = json.loads(storage.read_bytes(storage.join(ranks_dir, f"rank-{rank}.json")))
    except Exception:  # not written (the rank died first), or unreadable: the launcher's word alone
        return None
    return info if isinstance(info, dict) else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on this host now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_in_group(
    fn: RankFn, rank: int, world_size: int, init_method: str, payload: Any, timeout_s: float,
    guard: DriverGuard | None = None, lost_peer_grace_s: float = LOST_PEER_GRACE_S,
    slot: Slot | None = None,
    code: UserCode | None = None,
) -> Any:
    """Take the rank's device, join the process group, call `fn`, leave the group.

    `slot`: where the rank runs on its host (training.placement; None: the local
    launcher's, every rank on this machine). The rank's GPU is chosen from it and made
    current before the group exists, and handed to the group as its `device_id`; a host
    with more ranks than GPUs is refused here, a permanent error. `fn` finds the device
    in training.collectives.device().

    A payload with a `socket_ifname` (a RankJob: training.socket_ifname) names the
    network interface(s) the collectives use (launchers.network); None keeps the
    environment's choice.

    `fn` keeps every model and tensor in its own frame, and the group is left
    (barrier, destroy) before returning: a model or group still alive when a
    Spark barrier task yields made later jobs hang (seen with Spark 4.3). The timeout bounds
    how long a stopped peer can hang the others. `guard` ends this process if the
    job's driver goes away; a failure is raised as a `RankError` the driver can read.
    `code`: the user's code the launcher shipped (foundation.code_travel), made current in
    this process before `fn` runs, so `fn` imports this job's version of it.
    A payload with `group_from_env` true (a RankJob of `shardline.distribute`) joins no group:
    its function, written for torchrun, finds the rendezvous in the environment
    (launchers.torchrun_env) and joins it itself.
    A payload with a `ranks_dir` (a RankJob's) is where a bug's full traceback is written
    (`ranks/rank-N.log`), for the driver's one line to name (launchers.rank_errors).
    """
    from .. import collectives, placement
    from .network import socket_interface

    stop_guard = guard.start() if guard is not None else None
    try:
        slot = slot or placement.local_slot(rank, world_size)
        device = collectives.use(placement.rank_device(slot))
        placement.enter(slot)
        use_code(code)
        with socket_interface(getattr(payload, "socket_ifname", None)):
            if getattr(payload, "group_from_env", False):
                return _joining_itself(fn, rank, world_size, init_method, payload, slot)
            return _in_group(fn, rank, world_size, init_method, payload, timeout_s, device)
    except Exception as e:
        error = RankError.of(rank, e, getattr(payload, "ranks_dir", None))
        if not is_permanent(e):
            # This rank only saw a peer vanish: let the peer's own error be the first one
            # the launcher hears (Spark reports only the first failed task of a stage, Dask's
            # gather the first failed rank). The local launcher hears every rank and passes 0.
            time.sleep(lost_peer_grace_s)
        raise error from e
    finally:
        if stop_guard is not None:
            stop_guard.set()


def _in_group(fn: RankFn, rank: int, world_size: int, init_method: str, payload: Any, timeout_s: float,
              device) -> Any:
    """`fn` in the process group, joined on `device` and left (barrier, destroy) before returning
    (run_in_group says why)."""
    import torch.distributed as dist

    from .. import collectives, placement

    dist.init_process_group(
        collectives.backend(),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=dt.timedelta(seconds=timeout_s),
        **placement.group_device(device),
    )
    try:
        result = fn(rank, world_size, payload)
        collectives.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _joining_itself(fn: RankFn, rank: int, world_size: int, init_method: str, payload: Any, slot: Slot) -> Any:
    """`fn` with torchrun's variables exported and no group joined for it. Still in the group
    at its end, every rank meets there before it closes, as run_in_group's ranks do."""
    import torch.distributed as dist

    from .. import collectives
    from .torchrun_env import torchrun_environment

    with torchrun_environment(init_method, rank, world_size, slot):
        result = fn(rank, world_size, payload)
        if dist.is_initialized():
            collectives.barrier()
        return result
