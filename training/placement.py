"""Which GPU each rank uses: by its rank on its own host, never by its global rank.

A rank's device is decided by its launcher's view of where the ranks run, before the
process group exists (training.launchers.run_in_group):

- Every launcher knows each rank's host: the local launcher (all on this machine),
  Spark (the barrier stage's task addresses, in partition order: the rank order),
  Dask (the worker addresses the driver chose). `local_ranks` numbers the ranks of
  each host 0, 1, ... in rank order: a rank's `Slot`.
- A GPU given to one rank alone wins: the GPU Spark assigned the task
  (spark.task.resource.gpu.amount), or, for a Dask worker started with its own
  CUDA_VISIBLE_DEVICES (dask-cuda lists the worker's GPU first, rotated: "1,2,3,0"),
  device 0 of that worker. Indexing such a worker by local rank would put two ranks
  on one GPU.
- Otherwise the rank takes GPU `local_rank` of its host, and a host with more ranks
  than GPUs is refused in one line, before any rank joins the group.

Only `rank_device` looks at torch's CUDA; everything else is plain data, checked on CPU
by tests/test_placement.py with made-up hosts, device counts and assignments.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from dataclasses import dataclass

from shardline.foundation.errors import ShardlineError

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs).


@dataclass(frozen=True)
class Slot:
    """Where one rank runs: its host, its rank among that host's ranks, and a GPU given to
    it alone by its launcher (an index into the devices its process sees), if any."""

    host: str
    local_rank: int
    local_world: int
    gpu: int | None = None
    given_by: str = ""  # who gave `gpu`, for the error naming it


_here: Slot | None = None


def here() -> Slot | None:
    """This process's rank's slot, once run_in_group placed it (None outside a rank)."""
    return _here


def host_of(address: str) -> str:
    """The host of a worker or executor address: "tcp://10.0.0.5:40001", "10.0.0.5:40001",
    "[::1]:40001", "inproc://10.0.0.5/123/4" (an in-process Dask worker)."""
    rest = address.split("://", 1)[-1]
    if "/" in rest:
        return rest.split("/", 1)[0]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


def local_ranks(hosts: list[str]) -> list[tuple[int, int]]:
    """Each rank's (local rank, ranks on its host), for ranks on `hosts` in rank order."""
    seen: Counter = Counter()
    total = Counter(hosts)
    out = []
    for h in hosts:
        out.append((seen[h], total[h]))
        seen[h] += 1
    return out


def slots(hosts: list[str], gpus: list[int | None] | None = None, given_by: str = "") -> list[Slot]:
    """Every rank's Slot, from its host and the GPU its launcher gave it alone (or None)."""
    gpus = gpus or [None] * len(hosts)
    return [Slot(h, lr, lw, g, given_by if g is not None else "")
            for h, (lr, lw), g in zip(hosts, local_ranks(hosts), gpus)]


def own_visible_gpus(hosts: list[str], visible: list[str | None]) -> list[int | None]:
    """0 for each rank whose worker lists a GPU of its own first in CUDA_VISIBLE_DEVICES
    (dask-cuda's rotation: "0,1" and "1,0"), None for the others.

    A host's workers have GPUs of their own when each of them sets the variable and no two
    list the same GPU first; workers that see the same list (set for the whole host, or
    unset) share its GPUs, which they split by local rank."""
    first = [v.split(",")[0].strip() if v and v.strip() else None for v in visible]
    out: list[int | None] = []
    for h, f in zip(hosts, first):
        mates = [first[i] for i, other in enumerate(hosts) if other == h]
        own = f is not None and None not in mates and len(set(mates)) == len(mates)
        out.append(0 if own else None)
    return out


def cuda_index(slot: Slot, device_count: int, visible: str | None = None) -> int:
    """The CUDA device index of the rank in `slot`, on a host whose process sees
    `device_count` GPUs (`visible`: its CUDA_VISIBLE_DEVICES, named in the errors)."""
    seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if slot.gpu is not None:
        if not 0 <= slot.gpu < device_count:
            raise ShardlineError(
                f"GPU {slot.gpu} on host {slot.host}, given by {slot.given_by}, is not one of "
                f"the {device_count} GPU(s) this process sees{seen}"
            )
        return slot.gpu
    if slot.local_world > device_count:
        raise ShardlineError(
            f"{slot.local_world} ranks on host {slot.host}, but it has {device_count} GPU(s){seen}: "
            "lower training.world_size or add GPUs"
        )
    return slot.local_rank


def rank_device(slot: Slot, device_count: int | None = None):
    """The rank's torch device: its CUDA device (cuda_index), or the CPU without CUDA.
    `device_count` None asks torch (which creates no CUDA context for it)."""
    import torch

    if device_count is None:
        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_count == 0:
        return torch.device("cpu")
    return torch.device("cuda", cuda_index(slot, device_count, os.environ.get("CUDA_VISIBLE_DEVICES")))


def group_device(device) -> dict:
    """init_process_group's device arguments: `device_id` on a GPU (NCCL forms its
    communicator at once, on that GPU, and never guesses one); none on the CPU, where
    torch refuses a device_id that is not an accelerator."""
    return {"device_id": device} if device.type == "cuda" else {}


def local_slot(rank: int, world_size: int) -> Slot:
    """The local launcher's: every rank on this machine, its local rank its rank."""
    return Slot(socket.gethostname(), rank, world_size)


def enter(slot: Slot) -> None:
    global _here
    _here = slot
