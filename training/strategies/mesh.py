"""The device-mesh strategy: ddp, fsdp, tensor and pipeline are one strategy, on one
DeviceMesh whose shape (`[training.mesh]`, training.mesh_shape) says how much of each.

`MeshStrategy` checks a model against the mesh on the driver (the tensor-parallel plan, the
pipeline's stages, the batch), says what it will do, and on each rank builds the rank's
share: a whole model (`ModelRank`: tensor parallel, FSDP2 or DDP, in parallelize.py's order)
or, with pipeline stages, its stages (pipeline.PipelineRank, each stage parallelised the
same way). A layout whose ranks hold less than the whole model builds it on the meta device
and takes rank 0's values (parallelize.materialise): no rank holds it whole but rank 0's CPU,
once, before any gradient or optimizer state exists.
"""

from __future__ import annotations

import logging
import socket
import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardline.foundation.errors import ConfigError, ShardlineError

from .. import collectives
from ..batch import forward
from ..config import TrainingConfig
from ..mesh_shape import MeshShape, mesh_of, split_tp_groups
from ..models.inputs import ModelInputs
from ..models.plans import fsdp_units
from ..task import loss_for
from .base import ModelBuilder, OptimizerFactory, Parallel, Strategy, train_step
from .parallelize import Plans, apply_mesh, pipeline_is_no_module, apply_recompute, device_mesh, materialise, parallelize, recompute_paths
from .pipeline import PipelineRank
from .grid import RankPlace
from .pipeline_stages import check_pipeline, check_stage_plan, describe_pipeline, model_layers, stage_layers_of
from .precision import Precision
from .tensor import checked_plan

# torch warns, on every forward of an FSDP unit whose output is a view, that an in-place op
# on it (`h += unit(x)`) would skip the unit's pre-backward all-gather. A view is common and
# harmless by itself: nn.Linear on [batch, length, d] returns a view of its 2-D product (the
# decoder's blocks and head), nn.Flatten a view of its input (a CNN's features). shardline
# uses the root's output out of place (the loss), its built-in models modify no unit's output
# in place (residuals are `x + f(x)`), and each is checked against single-process training;
# the rule left for a model's own forward is in docs/guide/strategies.md. Only this warning,
# only from FSDP: 2-4 lines on every fsdp run said nothing a user had done.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                        category=UserWarning, module=r"torch\.distributed\.fsdp\.")
# A weight sharded over two mesh dimensions (FSDP2 over tensor parallel) takes two
# all-gathers to make whole (evaluation, export), which torch logs as a warning at every gather.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

# Full (unsharded) tensors on every rank: what the plain evaluation model needs.
_FULL = StateDictOptions(full_state_dict=True)
# Full tensors on rank 0 only, in host memory: each tensor is gathered, copied to rank 0's
# CPU and dropped on the others before the next one, so no rank holds the whole model on
# its device and only rank 0 holds it at all.
_EXPORT = StateDictOptions(full_state_dict=True, cpu_offload=True)


def label(shape: MeshShape) -> str:
    """The layout's name for its own figures and the epoch line: the dimension that splits
    the model most (pipeline over tensor over fsdp), else ddp."""
    return "pipeline" if shape.pp > 1 else "tensor" if shape.tp > 1 else "fsdp" if shape.dp_shard > 1 else "ddp"


class MeshStrategy(Strategy):
    """ddp, fsdp, tensor, pipeline: shorthands for meshes (mesh_shape.FILLED_BY)."""

    mesh: MeshShape

    def __init__(self, cfg: TrainingConfig):
        shape = mesh_of(cfg)
        super().__init__(cfg.mesh, shape, shape.data_world)
        self.name = label(shape)
        # Ranks that hold less than the whole model build it on the meta device (model_for).
        self.builds_model = shape.splits_model

    def plans(self, cfg: TrainingConfig, model: nn.Module, what: str | None = None) -> Plans:
        """The model's plans this mesh needs, each checked (one line naming the setting).
        `what` names the model in those lines (default: training.model's)."""
        shape = self.mesh
        what = what or f"training.model {cfg.model}"
        tp = checked_plan(cfg, model, shape.tp, what) if shape.tp > 1 else {}
        path = {id(m): n for n, m in model.named_modules()}
        recompute = recompute_paths(cfg.activation_checkpointing, model, what)
        if cfg.ddp.grad_compression != "none" and shape.splits_model:
            raise ConfigError(
                f"training.ddp.grad_compression {cfg.ddp.grad_compression}: DDP's communication hook, for a "
                f"mesh of plain replicas (dp_replicate alone); this mesh is {shape.named()}"
            )
        return Plans(tp=tp, units=tuple(path[id(u)] for u in fsdp_units(model)), recompute=recompute,
                     grad_compression=cfg.ddp.grad_compression)

    def check(self, cfg: TrainingConfig, model: nn.Module, inputs: ModelInputs | None = None) -> None:
        shape = self.mesh
        if cfg.strategy == "pipeline" and shape.pp < 2:
            raise ConfigError(
                f"training.mesh.pp {shape.pp}: strategy pipeline needs at least 2 stages (one model "
                "replica per rank is strategy ddp)"
            )
        if cfg.batch_size % shape.data_world:
            raise ConfigError(
                f"training.batch_size {cfg.batch_size} must be a multiple of the {shape.data_world} "
                f"data-parallel ranks (training.mesh {shape.named()})"
            )
        plans = self.plans(cfg, model)
        if shape.pp > 1:
            check_pipeline(cfg, shape, model, inputs)
            if plans.tp:
                check_stage_plan(cfg, shape, model, plans.tp)

    def describe(self, cfg: TrainingConfig, model: nn.Module) -> str:
        return describe_pipeline(cfg, self.mesh, model) if self.mesh.pp > 1 else ""

    def title(self, cfg: TrainingConfig) -> str:
        shape = self.mesh
        order = "pp, dp_replicate, dp_shard, tp: tp innermost"
        return (f"mesh: {shape.named()} = {shape.world} rank(s), strategy {cfg.strategy} (rank order {order}; "
                f"each batch read in {shape.data_world} part(s))")

    def place(self, cfg: TrainingConfig, model: nn.Module, rank: int) -> RankPlace:
        shape = self.mesh
        c = shape.coordinates(rank)
        shown = {d: i for d, i in c.items() if getattr(shape, d) > 1} or {"dp_replicate": 0}
        stage, mine = "all layers", None  # mine: the names of the layers this rank holds (None: all)
        if shape.pp > 1:
            names = [n for n, _ in model_layers(cfg, model)]
            stages = stage_layers_of(cfg, shape, model, c["pp"])
            mine = {n for _, lo, hi in stages for n in names[lo:hi]}
            stage = "; ".join(
                f"stage {s}: layer{'s' if hi - lo > 1 else ''} {lo}{f'-{hi - 1}' if hi - lo > 1 else ''} "
                f"({', '.join(names[lo:hi])})" for s, lo, hi in stages)
        held = []
        if shape.tp > 1:
            split = [p for p in self.plans(cfg, model).tp if mine is None or p.split(".")[0] in mine]
            held.append(f"tp {c['tp'] + 1}/{shape.tp} of {len(split)} split Linear layers")
        if shape.dp_shard > 1:
            held.append(f"FSDP {c['dp_shard'] + 1}/{shape.dp_shard} of each parameter")
        return RankPlace(coordinates=shown, stage=stage, tensor=", ".join(held) or "whole",
                         data_rank=shape.data_rank(rank))

    def setup(
        self, model: nn.Module | ModelBuilder, cfg: TrainingConfig, rank: int, world_size: int,
        device: torch.device, make_optimizer: OptimizerFactory,
    ) -> Parallel:
        shape = self.mesh
        build = None if isinstance(model, nn.Module) else model
        if build is not None:
            with torch.device("meta"):
                model = build()
        plans = self.plans(cfg, model)
        mesh = device_mesh(shape, device) if world_size > 1 else None
        if mesh is not None and shape.tp > 1:
            check_tp_hosts(shape, device)
        if shape.pp > 1:
            return PipelineRank(model, cfg, rank, device, make_optimizer, mesh, plans, build)
        precision = Precision.of(cfg)
        if mesh is not None:
            runner = parallelize(model, mesh, plans, precision)
        else:  # one process: recompute is the one step left
            apply_recompute(model, plans.recompute)
            runner = model
        if build is not None:
            materialise(model, model, build, rank, device)
        return ModelRank(model, runner, cfg, shape, rank, device, make_optimizer)

    def prepare_module(self, model: nn.Module, cfg: TrainingConfig, world_size: int,
                       device: torch.device) -> nn.Module:
        """A user's own model (every rank's, the same values) with this mesh applied, on
        `device`: parallelize.apply_mesh with the job's mesh, the model's plans (checked) and
        the job's precision; what a loop's `ctx.prepare` runs. A mesh with pipeline stages is
        refused in one line (its step is the schedule's: ctx.parallel). Collective."""
        if self.mesh.pp > 1:
            raise ConfigError(pipeline_is_no_module(self.mesh.pp))
        model = model.to(device)
        plans = self.plans(cfg, model, f"ctx.prepare: {type(model).__name__}")
        if world_size == 1:
            apply_recompute(model, plans.recompute)
            return model
        return apply_mesh(model, device_mesh(self.mesh, device), plans, Precision.of(cfg))


def check_tp_hosts(shape: MeshShape, device: torch.device) -> None:
    """On GPUs a tensor-parallel group must sit on one host: its all-reduces run in every
    layer, forward and backward, at the speed of the host's GPU links (NVLink), never of the
    network. Collective (every rank learns every rank's host). On CPUs gloo's all-reduce is
    the same over the network, and the check only names nothing."""
    hosts = collectives.all_gather_object(socket.gethostname())
    split = split_tp_groups(shape, hosts)
    if split and device.type == "cuda":
        group = split[0]
        raise ShardlineError(
            f"training.mesh.tp {shape.tp}: ranks {', '.join(map(str, group))} of one tensor-parallel group run on "
            f"hosts {', '.join(sorted({hosts[r] for r in group}))}: give each host a multiple of tp ranks, "
            "consecutive in rank order (the launcher's placement), or lower training.mesh.tp"
        )


class ModelRank(Parallel):
    """One rank of a mesh without pipeline stages: the whole model, its planned layers split
    over tp, its parameters sharded (FSDP2) or replicated (DDP) over the data dimensions."""

    def __init__(self, model: nn.Module, runner: nn.Module, cfg: TrainingConfig, shape: MeshShape, rank: int,
                 device: torch.device, make_optimizer: OptimizerFactory):
        self.model, self.runner, self.rank = model, runner, rank  # runner: what the step calls (DDP wraps)
        self.optimizer = make_optimizer(runner.parameters())
        self.autocast = Precision.of(cfg).autocast(device)
        self.loss = loss_for(cfg)
        self.data_rank, self.data_world, self.reports = shape.data_rank(rank), shape.data_world, shape.reports(rank)
        # Parameters are DTensors (sharded or split): the plain model's come from torch's state-dict API.
        self.distributed = shape.splits_model
        # FSDP alone: every rank evaluates its own part of the validation split with the sharded
        # model, in lockstep (the forward gathers layers); no plain model is built for it. With
        # tensor parallel the ranks of a tp group would need the same batches: they evaluate a
        # plain model on the gathered weights, as every other layout does.
        self.evaluates_sharded = shape.dp_shard > 1 and shape.tp == 1

    def step(self, x, y):
        self.runner.train()
        out = train_step(self.runner, self.optimizer, self.autocast, x, y, self.loss)
        return out if self.reports else None

    @torch.no_grad()
    def forward_eval(self, x) -> torch.Tensor:
        """The sharded model's outputs (fp32) on a batch's inputs (features or named tensors),
        in the training precision. Collective: every rank of the mesh calls it equally often."""
        self.model.eval()
        with self.autocast:
            return forward(self.model, x).float()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if not self.distributed:
            return self.model.state_dict()
        return get_model_state_dict(self.model, options=_FULL)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's weights on rank 0, in host memory; {} on the other ranks.
        Collective where the weights are DTensors; a replica (DDP) copies its own."""
        if self.distributed:
            return get_model_state_dict(self.model, options=_EXPORT)
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()} if self.rank == 0 else {}
