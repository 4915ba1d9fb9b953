"""Every collective call training makes, and the device contract they keep.

NCCL, the GPU backend, only moves tensors that live on the rank's own GPU; gloo moves
host memory. A CPU tensor handed to an NCCL group fails at run time, on a GPU host
only — which this project has never had. So every tensor collective in training
(worker metrics, evaluation, epoch end, stop flags, gathers, the strategies' own
exchanges) goes through this module, and the module checks, before the call, that the
tensor is on the rank's device (`use`: the one training.placement chose), or in host
memory for a group created host-only (`new_host_group`). A wrong one is refused with `DeviceContractError`,
naming the call and both devices, on CPU as on GPU: that check, and a test that no
module in `training/` calls torch.distributed's collectives except this one, are what
guard the GPU path here.

On a GPU host the world group is `cpu:gloo,cuda:nccl` (`backend()`): GPU tensors go
through NCCL, and object collectives (pickled Python objects: each rank's resume state,
its strategy figures, DCP's save plans) through gloo in host memory, so they need no
round trip through the GPU. PyTorch's own blocks (DDP, DTensor, FSDP2, pipelining, DCP)
issue their collectives themselves on the mesh's device type; they are not routed here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

_device = torch.device("cpu")
# Groups created host-only (gloo whatever the world's backend): their tensors live on the CPU.
_host_groups: list[dist.ProcessGroup] = []
# (call, device type) -> how many tensors went through it: shows the checks ran (tests).
_calls: Counter = Counter()


class DeviceContractError(RuntimeError):
    """A tensor handed to a collective is not where the group's backend can read it (a bug)."""


def backend() -> str:
    """The world group's backend: NCCL for GPU tensors plus gloo for host memory on a
    GPU host; gloo alone on a CPU-only one."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def use(device: torch.device) -> torch.device:
    """Make `device` this rank's (chosen by training.placement before the group exists):
    the current CUDA device of the calling thread, and the device of every collective."""
    if device.type == "cuda":
        # NCCL and the object collectives use the current device: make it this rank's.
        torch.cuda.set_device(device)
    return bind(device)


def enter_rank_device(set_device=None) -> None:
    """In a thread the rank started (the loader's producer), make the rank's GPU the current
    device: CUDA's current device is per thread, and a new thread's is GPU 0, where pinning
    memory or any other CUDA call would open a context of its own. Nothing on the CPU.
    `set_device`: torch.cuda.set_device unless given (tests pass a recorder)."""
    if _device.type == "cuda":
        (set_device or torch.cuda.set_device)(_device)


def bind(device: torch.device) -> torch.device:
    """The device every tensor collective of this process must use from now on."""
    global _device
    _device = torch.device(device)
    return _device


def device() -> torch.device:
    return _device


def tensor(values, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of `values` on the rank's device: what the worker's metrics travel in."""
    return torch.tensor(values, dtype=dtype, device=_device)


def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device=_device)


def new_host_group(ranks: list[int] | None = None) -> dist.ProcessGroup:
    """A gloo group over `ranks` (all: None) whatever the world's backend: it receives from
    any source, which NCCL cannot. Its tensors must be in host memory. Collective."""
    group = dist.new_group(ranks, backend="gloo")
    _host_groups.append(group)
    return group


def expected_device(group: dist.ProcessGroup | None) -> torch.device:
    if group is not None and any(group is g for g in _host_groups):
        return torch.device("cpu")
    return _device


def check(t: torch.Tensor, call: str, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Refuse a tensor the group's backend cannot read; count the ones it can."""
    want = expected_device(group)
    if t.device != want:
        taker = "this host-memory (gloo) group" if want != _device else "this rank's collectives"
        raise DeviceContractError(
            f"{call}: a tensor on {t.device}, but {taker} take tensors on {want} "
            "(make it with training.collectives.tensor/zeros, or move it there)"
        )
    _calls[(call, t.device.type)] += 1
    return t


def calls() -> dict[tuple[str, str], int]:
    """(call, device type) -> tensors checked and passed, since the process started."""
    return dict(_calls)


# Tensor collectives: torch.distributed's own signatures, checked first.


def all_reduce(t: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False):
    return dist.all_reduce(check(t, "all_reduce", group), op=op, group=group, async_op=async_op)


def reduce(t: torch.Tensor, dst: int, group=None, async_op: bool = False):
    return dist.reduce(check(t, "reduce", group), dst, group=group, async_op=async_op)


def broadcast(t: torch.Tensor, src: int, group=None, async_op: bool = False):
    return dist.broadcast(check(t, "broadcast", group), src, group=group, async_op=async_op)


def all_gather(out: list[torch.Tensor], t: torch.Tensor, group=None) -> None:
    for o in out:
        check(o, "all_gather", group)
    dist.all_gather(out, check(t, "all_gather", group), group=group)


def isend(t: torch.Tensor, dst: int, group=None, tag: int = 0) -> dist.Work:
    return dist.isend(check(t, "isend", group), dst, group=group, tag=tag)


def recv(t: torch.Tensor, src: int | None = None, group=None, tag: int = 0) -> int:
    """Receive into `t`; returns the sender's rank (from any source when src is None)."""
    return dist.recv(check(t, "recv", group), src, group=group, tag=tag)


# Object collectives: pickled Python objects, through host memory (see backend()). A
# tensor inside is moved to the CPU first: pickled on a GPU it would unpickle onto the
# sender's device index on the receiving rank, another rank's GPU.


def host_copy(obj: Any) -> Any:
    """`obj` with every tensor in its dicts, lists and tuples moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


def gather_object(obj: Any, dst: int = 0) -> list | None:
    """Every rank's `obj` (tensors on the CPU), on rank `dst` (None elsewhere)."""
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(host_copy(obj), out, dst=dst)
    return out


def all_gather_object(obj: Any, group=None) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, host_copy(obj), group=group)
    return out


def barrier(group=None) -> None:
    dist.barrier(group=group)
