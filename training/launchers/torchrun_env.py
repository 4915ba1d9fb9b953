"""The environment torchrun and PySpark's TorchDistributor give each rank, for a function
written for them (`shardline.distribute`): the function joins the process group itself.

torchrun (and TorchDistributor, which runs torchrun) exports `MASTER_ADDR`, `MASTER_PORT`,
`RANK`, `WORLD_SIZE`, `LOCAL_RANK` and `LOCAL_WORLD_SIZE` and initialises nothing: the
function calls `dist.init_process_group(backend)` (`init_method="env://"`, the default),
whose rank 0 binds its store at MASTER_PORT. shardline's launchers agree on the same
address (`tcp://host:port`, rank 0's host, a port free there) and export it instead of
joining the group for the function.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from urllib.parse import urlsplit

from ..placement import Slot

NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def torchrun_variables(init_method: str, rank: int, world_size: int, slot: Slot) -> dict[str, str]:
    """What torchrun exports for rank `rank`, from the launcher's rendezvous address."""
    address = urlsplit(init_method)
    return {
        "MASTER_ADDR": address.hostname or "127.0.0.1", "MASTER_PORT": str(address.port),
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(slot.local_rank), "LOCAL_WORLD_SIZE": str(slot.local_world),
    }


@contextmanager
def torchrun_environment(init_method: str, rank: int, world_size: int, slot: Slot):
    """The variables exported while the function runs, and the process as it was after: a
    Spark Python worker and a Dask worker outlive the rank (the next job's rank must not
    read this one's RANK), and a process group the function left open is closed (a group
    alive in a reused Spark worker fails the next `init_process_group` there)."""
    import torch.distributed as dist

    before = {name: os.environ.get(name) for name in NAMES}
    os.environ.update(torchrun_variables(init_method, rank, world_size, slot))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
