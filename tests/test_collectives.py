"""The device contract of training's collectives (training/collectives.py), checked on CPU.

No GPU exists here, so what guards the GPU path is: no module in training/ calls
torch.distributed's collectives except collectives.py; collectives.py refuses a tensor
that is not on the rank's device (or, for a gloo-only group, in host memory) before the
call; and every strategy's job passes that check (tests/test_strategy_jobs.py asserts the
checked calls a real job made).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from shardline.training import collectives
from shardline.training.collectives import DeviceContractError
from shardline.engines.local.launch import launch_local

TRAINING = Path(__file__).resolve().parent.parent / "training"

# torch.distributed's calls that move data between ranks.
MOVING = {
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier", "gather_object",
    "all_gather_object", "broadcast_object_list", "scatter_object_list", "send_object_list",
    "recv_object_list",
}


def _direct_calls(path: Path) -> list[str]:
    """`dist.X(...)` / `torch.distributed.X(...)` calls of a moving collective, and imports of one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MOVING:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                found.append(f"{path.name}:{node.lineno} {owner}.{node.func.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names if a.name in MOVING]
    return found


def test_only_the_collectives_module_calls_torch_distributed_collectives():
    files = [p for p in TRAINING.rglob("*.py") if p.name != "collectives.py"]
    assert len(files) > 10
    offenders = [c for p in files for c in _direct_calls(p)]
    assert offenders == [], offenders
    # The scan finds what it looks for: collectives.py itself is full of them.
    assert len(_direct_calls(TRAINING / "collectives.py")) >= 8


def test_a_tensor_off_the_rank_device_is_refused_before_any_call():
    # No process group exists in this process: a refusal comes before torch.distributed is touched.
    wrong = torch.zeros(3, device="meta")
    for call in (
        lambda: collectives.all_reduce(wrong),
        lambda: collectives.broadcast(wrong, 0),
        lambda: collectives.reduce(wrong, 0),
        lambda: collectives.isend(wrong, 1),
        lambda: collectives.recv(wrong, 0),
        lambda: collectives.all_gather([torch.zeros(3)], wrong),
    ):
        with pytest.raises(DeviceContractError, match=r"a tensor on meta, but this rank's collectives take tensors on cpu"):
            call()


def test_the_contract_follows_the_bound_device():
    before = collectives.device()
    try:
        collectives.bind(torch.device("meta"))
        # The module's own tensors land on the bound device, and pass; a CPU one does not.
        assert collectives.tensor([1.0]).device.type == collectives.zeros(2).device.type == "meta"
        assert collectives.check(collectives.zeros(2), "all_reduce").device.type == "meta"
        with pytest.raises(DeviceContractError, match="a tensor on cpu, but this rank's collectives take tensors on meta"):
            collectives.check(torch.zeros(2), "all_reduce")
    finally:
        collectives.bind(before)


def _host_group_contract(rank: int, world_size: int, _) -> dict:
    """A gloo-only group takes host memory even when the rank's device is another."""
    host = collectives.new_host_group()
    collectives.bind(torch.device("meta"))  # stands in for a GPU: any device that is not the CPU
    out = {}
    try:
        collectives.all_reduce(torch.ones(2), group=host)
        out["host_ok"] = True
    except DeviceContractError as e:
        out["host_ok"] = str(e)
    try:
        collectives.all_reduce(torch.ones(2))  # the world group: the rank's device only
        out["world"] = "passed"
    except DeviceContractError as e:
        out["world"] = str(e)
    collectives.bind(torch.device("cpu"))
    out["calls"] = collectives.calls()
    return out


def test_a_host_memory_group_takes_cpu_tensors_whatever_the_rank_device():
    for got in launch_local(_host_group_contract, None, world_size=2, timeout_s=120):
        assert got["host_ok"] is True
        assert "a tensor on cpu, but this rank's collectives take tensors on meta" in got["world"]
        assert got["calls"] == {("all_reduce", "cpu"): 1}


def test_backend_is_gloo_without_cuda_and_per_device_with_it():
    expected = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    assert collectives.backend() == expected


def test_using_the_cpu_binds_the_contract_and_touches_no_cuda():
    before = collectives.device()
    try:
        collectives.bind(torch.device("meta"))
        assert collectives.use(torch.device("cpu")) == collectives.device() == torch.device("cpu")
    finally:
        collectives.bind(before)


def test_object_collectives_send_host_copies():
    state = {"optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}, "steps": [torch.zeros(1), 3]}, "t": (torch.ones(1),)}
    copy = collectives.host_copy(state)
    assert copy["optimizer"]["steps"][1] == 3 and isinstance(copy["t"], tuple)
    assert all(t.device.type == "cpu" for t in (copy["optimizer"]["state"][0]["exp_avg"], copy["t"][0]))
