"""Parallelisms composed on one DeviceMesh: the order they are applied in, and why.

The mesh has four named dimensions (training.mesh_shape: pp, dp_replicate, dp_shard, tp, tp
innermost). A rank's model goes through torchtitan's order (`parallelize_llama`), each step a
small function below, with torch's own blocks; the model never knows:

1. **Pipeline split** (torch.distributed.pipelining; the model's declared `pipeline_layers()`,
   pipeline.py cuts them): first, because every later step works on what the rank keeps: tensor
   parallel and FSDP on a stage the rank never runs would allocate and talk for nothing.
2. **Tensor parallel on each part** (DTensor `parallelize_module`, the model's `tp_plan()`):
   before FSDP, because FSDP2 shards the parameters it finds: a tp-split weight, already a
   DTensor on the tp dimension, is sharded again over the data dimensions (one DTensor over
   both). The other way round, tensor parallel would split FSDP's shards, not the layer.
3. **Activation checkpointing** (the model's `recompute_units()`): after tensor parallel, so
   the recompute in backward reruns the split forward with its collectives; before FSDP, so
   FSDP's hooks on a unit wrap the checkpointed forward and the recompute runs while the
   unit's parameters are gathered.
4. **Mixed precision**: one `Precision` object (precision.py): FSDP2's parameter and reduction
   dtypes given to step 5, and the autocast the step (or a pipeline stage) runs under.
5. **Data parallel over (dp_replicate, dp_shard)**, last because it wraps what the rank finally
   holds: FSDP2 `fully_shard` on each unit, then on the part (HSDP on the 2-D data mesh when
   dp_replicate > 1; with dp_shard 1 that is plain replication through FSDP2, which, unlike
   DDP, takes DTensor parameters). Replicas of plain tensors (no dp_shard, no tp) are
   plain data parallel: DDP for a whole model (its bucketed all-reduce and communication
   hooks, [training.ddp]); pipeline stages' gradients all-reduced once after the schedule's
   step (pipeline.py: every schedule, zero-bubble's split backward too, which FSDP2's
   reduction misses in torch 2.13, and which DDP's hooks do not see either).

`apply_mesh` runs steps 2-5 on a whole model (a mesh without pipeline stages): what a user's
own loop asks for (`ctx.prepare`). The built-in training runs the same functions per stage
(mesh.py, pipeline.py). A model built on the meta device (a rank never holds it whole) gets
its values after the split (`materialise`): rank 0's plain model, a tensor at a time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from shardline.foundation.errors import ConfigError

from .. import collectives
from ..mesh_shape import DIMENSIONS, MeshShape
from ..models.plans import recompute_units
from .precision import NORMS, Precision

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# torch 2.13 warns that slicing a flattened dimension (dp_shard_tp) out of the root mesh "will
# be deprecated", asking callers to keep the flattened mesh; but the 2-D (dp_replicate,
# dp_shard_tp) mesh HSDP needs exists only as such a slice (fully_shard's public alternative,
# dp_mesh_dims, refuses parameters that are plain tensors: the very ones sharded there).
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning,
                        module=r"torch\.distributed\.device_mesh")
# Rank 0's plain tensors broadcast one at a time, each rank keeping its slice.
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)


@dataclass(frozen=True)
class Plans:
    """What the mesh needs from a model, by module path in the plain model (a pipeline
    stage keeps the plain names, so the same paths reach into it): made and checked on the
    driver (mesh.MeshStrategy.plans), applied on every rank."""

    tp: dict[str, str]  # module path -> "colwise" | "rowwise"; {} without tensor parallel
    units: tuple[str, ...]  # FSDP units, each sharded (gathered, freed) on its own before the part
    recompute: tuple[str, ...] | None  # activation checkpointing's units; None: off
    grad_compression: str = "none"  # DDP's communication hook ([training.ddp]): plain replicas only


def recompute_paths(activation_checkpointing: bool, model: nn.Module, what: str) -> tuple[str, ...] | None:
    """The module paths activation checkpointing recomputes (the model's recompute_units());
    None when it is off. A model that declares none is refused in one line."""
    if not activation_checkpointing:
        return None
    units = recompute_units(model)
    if units is None:
        raise ConfigError(
            f"training.activation_checkpointing: {what} declares no recompute_units() or fsdp_units() "
            "(the submodules to recompute)"
        )
    path = {id(m): n for n, m in model.named_modules()}
    return tuple(path[id(u)] for u in units)


def device_mesh(shape: MeshShape, device: torch.device) -> DeviceMesh:
    """torch's DeviceMesh of `shape`, its dimensions named as mesh_shape.DIMENSIONS (size 1
    included, so `mesh["dp_replicate", "dp_shard"]` always exists), and "dp_shard_tp", the
    dp_shard and tp dimensions as one (where what tensor parallel leaves whole is sharded:
    apply_data_parallel). Collective: every rank builds every group, in the same order."""
    mesh = init_device_mesh(device.type, shape.sizes, mesh_dim_names=DIMENSIONS)
    # torch 2.13 flattens dimensions only through this private method (torchtitan's way too).
    mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
    return mesh


def shape_of(mesh: DeviceMesh) -> MeshShape:
    return MeshShape(**{d: mesh[d].size() for d in DIMENSIONS})


def apply_mesh(model: nn.Module, mesh: DeviceMesh, plans: Plans, precision: Precision) -> nn.Module:
    """`model` (every rank's, the same values) with the mesh's tensor parallel, activation
    checkpointing, precision and data parallel applied, in that order: the module to run
    forward on (a DDP wrapper, or `model` itself changed in place). A mesh with pipeline
    stages is not one module per rank: its step is the schedule's (pipeline.py)."""
    if mesh["pp"].size() > 1:
        raise ConfigError(pipeline_is_no_module(mesh["pp"].size()))
    return parallelize(model, mesh, plans, precision)


def pipeline_is_no_module(pp: int) -> str:
    return (f"training.mesh.pp {pp}: a pipeline runs its stages by its schedule, not as one module: use "
            "ctx.parallel(model, optimizer_factory) and its .step(x, y)")


def parallelize(part: nn.Module, mesh: DeviceMesh, plans: Plans, precision: Precision) -> nn.Module:
    """Steps 2-5 on one part (a whole model, or a pipeline stage holding plain-named layers)."""
    apply_tensor_parallel(part, mesh, plans.tp)
    apply_recompute(part, plans.recompute)
    return apply_data_parallel(part, mesh, plans, precision)


def _within(part: nn.Module, paths) -> list[tuple[str, nn.Module]]:
    """(path, module) of the paths that lie in `part` (a stage holds some layers only)."""
    out = []
    for path in paths:
        try:
            out.append((path, part.get_submodule(path)))
        except AttributeError:
            continue
    return out


def apply_tensor_parallel(part: nn.Module, mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """Step 2: each planned Linear split over the tp dimension (colwise: its output
    features; rowwise: its input features, the partial outputs all-reduced). Everything off
    the plan stays whole: after a rowwise all-reduce every tp rank holds the same activations."""
    if mesh["tp"].size() == 1:
        return
    styles = {path: STYLES[plan[path]]() for path, _ in _within(part, plan)}
    if styles:
        parallelize_module(part, mesh["tp"], styles)


def apply_recompute(part: nn.Module, units: tuple[str, ...] | None) -> None:
    """Step 3: each unit's forward recomputed in backward instead of its activations kept.
    The forward is replaced on the instance, so parameter names (checkpoints, the registered
    model) do not change. use_reentrant=False: the reentrant variant drops gradients when
    inputs do not require grad."""
    if units is None:
        return
    for _, layer in _within(part, units):
        layer.forward = _recomputed(layer)


def _recomputed(layer: nn.Module) -> Callable:
    own = type(layer).forward.__get__(layer)

    def forward(*args, **kwargs):
        return checkpoint(own, *args, use_reentrant=False, **kwargs)

    return forward


def apply_data_parallel(part: nn.Module, mesh: DeviceMesh, plans: Plans, precision: Precision) -> nn.Module:
    """Step 5 (with step 4's FSDP policy). Returns the module to run: a DDP wrapper for
    plain replicas, else `part` (FSDP2 changes it in place).

    Each unit (the model's fsdp_units()) is sharded on its own, then the part (the rest):
    a rank gathers one unit at a time. A unit tensor parallel left whole (no DTensor in it: an
    embedding, a vocabulary head, their norms) is sharded over the tp ranks too, where the
    mesh also shards or stages the model (dp_shard, pp): the tp ranks of a data part compute
    it alike, from the same inputs, so they are its replicas just as data ranks are, and
    holding it whole on each was the largest part of a combined layout's memory (measured:
    `shardline bench sharding`, docs/benchmarks.md). Tensor parallel alone keeps Megatron's
    layout, whole parts replicated: the meaning of the strategy `tensor`."""
    shape = shape_of(mesh)
    whole = _whole_mesh(mesh, shape)
    if (shape.data_world == 1 and whole is None) or (plain_replicas(shape) and shape.pp > 1):
        return part  # nothing to do, or the pipeline averages its plain replicas' gradients
    if plain_replicas(shape):
        ddp = DistributedDataParallel(part)
        if plans.grad_compression == "fp16":
            # Gradients travel as fp16 and are cast back: half the all-reduce bytes.
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp
    # HSDP (replicas of a sharded model) on the 2-D data mesh; FSDP on the shard dimension alone.
    data = None if shape.data_world == 1 else mesh["dp_replicate", "dp_shard"] if shape.dp_replicate > 1 \
        else mesh["dp_shard"]
    policy = precision.fsdp_policy()
    norm_policy = precision.norm_policy()
    units = [(m, norm_policy) for m in part.modules() if isinstance(m, NORMS)] if norm_policy else []
    units += [(unit, policy) for _, unit in _within(part, plans.units)]
    for unit, unit_policy in units:
        target = whole if whole is not None and not _has_dtensor(unit) else data
        if target is not None and _has_parameters(unit) and not isinstance(unit, FSDPModule):
            fully_shard(unit, mesh=target, mp_policy=unit_policy)
    if data is not None:
        fully_shard(part, mesh=data, mp_policy=policy)
    return part


def _whole_mesh(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh | None:
    """Where the units tensor parallel leaves whole are sharded: dp_shard and tp as one
    dimension (replicated over dp_replicate: HSDP), in a mesh that splits the model by tp
    and also shards or stages it; None elsewhere."""
    if shape.tp == 1 or (shape.dp_shard == 1 and shape.pp == 1):
        return None
    return mesh["dp_replicate", "dp_shard_tp"] if shape.dp_replicate > 1 else mesh["dp_shard_tp"]


def _has_dtensor(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def plain_replicas(shape: MeshShape) -> bool:
    """The data dimensions only replicate plain tensors: no dp_shard and no tp."""
    return shape.dp_shard == 1 and shape.tp == 1


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def materialise(held: nn.Module, meta_model: nn.Module, build: Callable[[], nn.Module], rank: int,
                device: torch.device) -> None:
    """Give `held` (what this rank keeps of a model built on the meta device and
    parallelised there, under the plain model's names) the seeded plain model's values, with
    no rank but rank 0 ever holding it whole, and rank 0 only its weights, in host memory,
    before any gradient or optimizer state exists (as Accelerate's cpu_ram_efficient_loading
    and torchtitan's seed checkpoint do).

    Re-initialising the shards under the seed would not give those values: the seed's stream
    is drawn in the factory's order over whole tensors. So rank 0 builds the plain model for
    real on the CPU and torch's state-dict API broadcasts it a tensor at a time, each rank
    keeping its slice of what it holds (a DTensor's local shard); then rank 0 drops it.
    Buffers left out of the state dict (persistent=False) follow the same way, in the plain
    model's order (`meta_model`: every rank's meta copy of it). Collective."""
    held.to_empty(device=device)
    plain = build() if rank == 0 else None
    set_model_state_dict(held, plain.state_dict() if plain is not None else {}, options=_FROM_RANK0)
    saved = set(meta_model.state_dict())
    mine = dict(held.named_buffers())
    plain_buffers = dict(plain.named_buffers()) if plain is not None else {}
    for name, meta in meta_model.named_buffers():
        if name in saved:
            continue
        buf = plain_buffers[name].to(device) if plain is not None else torch.empty_like(meta, device=device)
        collectives.broadcast(buf, src=0)
        if name in mine:
            mine[name].copy_(buf)
    # Every rank's generator as if it had built the plain model (rank 0's, which did): a
    # model that draws in its forward (dropout) starts from where single-process training would.
    torch.set_rng_state(collectives.all_gather_object(torch.get_rng_state() if rank == 0 else None)[0])
