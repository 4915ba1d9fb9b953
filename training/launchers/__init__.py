"""Launchers: agree on rank, world size and a rendezvous address, then call one rank function.

A rank function is `fn(rank, world_size, payload) -> result`, called inside an
initialised process group; `train_rank` (training.worker) is the one jobs use.
"""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import Callable
from typing import Any

from pipelines.errors import ShardlineError

RankFn = Callable[[int, int, Any], Any]


class TrainingFailed(ShardlineError):
    """A rank failed; the message carries the rank's own error line."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on this host now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_in_group(
    fn: RankFn, rank: int, world_size: int, init_method: str, payload: Any, timeout_s: float
) -> Any:
    """Join the process group, call `fn`, leave the group.

    A payload with a `socket_ifname` (a TrainJob: training.socket_ifname) names the
    network interface(s) the collectives use (launchers.network); None keeps the
    environment's choice.

    `fn` keeps every model and tensor in its own frame, and the group is left
    (barrier, destroy) before returning: a model or group still alive when a
    Spark barrier task yields made later jobs hang (FACTS.md). The timeout bounds
    how long a stopped peer can hang the others.
    """
    import torch.distributed as dist

    from .. import collectives
    from .network import socket_interface

    with socket_interface(getattr(payload, "socket_ifname", None)):
        dist.init_process_group(
            collectives.backend(),
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=dt.timedelta(seconds=timeout_s),
        )
        try:
            result = fn(rank, world_size, payload)
            collectives.barrier()
            return result
        finally:
            dist.destroy_process_group()
