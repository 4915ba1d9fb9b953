"""Fully sharded data parallel (FSDP2 `fully_shard`, ZeRO-3), and HSDP on a 2-D mesh.

Every rank reads its own part of each global batch, as with DDP, but holds only
1/dp_shard of each parameter, of its gradient and of its optimizer state: before a
layer's forward (and again in its backward) its parameters are all-gathered from the
shard group, and after its backward its gradients are reduce-scattered, so each rank
steps the optimizer on its own shard. The mean over the shard group of equal local
batches' mean-loss gradients is the global batch's: single-process training on it.

HSDP (dp > 1): the mesh is dp replicas x dp_shard; each replica group shards as above
and the replicas all-reduce their gradient shards. FSDP2 takes the 2-D mesh as it is.

The model's FSDP units (training.models.plans.fsdp_units: its `fsdp_units()`, else each
child of a Sequential) are sharded each on its own (parameters gathered just before it
runs, freed after), then the root: at most one unit is whole at a time.

The saving holds outside the step too (`build_sharded`): the model is built on the
meta device and each rank allocates only its shards; evaluation runs the sharded model
(`forward_eval`); checkpoints are each rank's shards (DCP); the plain model's weights
are gathered once, at export, to rank 0's host memory (`export_state_dict`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardline.foundation.errors import ConfigError

from .. import collectives
from ..batch import forward
from ..config import TrainingConfig
from ..models.inputs import ModelInputs
from ..models.plans import fsdp_units
from ..task import loss_for
from ..strategy_settings import FsdpSettings
from .base import Mesh, ModelBuilder, OptimizerFactory, Parallel, Strategy, autocast_for, mesh_for, train_step

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

# Full (unsharded) tensors on every rank: what the plain evaluation model of tensor parallel needs.
_FULL = StateDictOptions(full_state_dict=True)
# Full tensors on rank 0 only, in host memory: each tensor is gathered, copied to rank 0's
# CPU and dropped on the others before the next one, so no rank holds the whole model on
# its device and only rank 0 holds it at all.
_EXPORT = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Rank 0's plain tensors broadcast one at a time, each rank keeping its slice.
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def mixed_precision(cfg: TrainingConfig) -> MixedPrecisionPolicy:
    """precision "bf16": parameters gathered (and so all-gathered) in bf16, gradients
    reduced in fp32, the sharded master weights and optimizer state fp32. The forward's
    inputs are not cast (cast_forward_inputs=False): a feature tensor carries category
    indices as floats, which bf16 holds exactly only up to 256; autocast (kept, as every
    strategy runs it) casts what each op needs instead."""
    if cfg.precision != "bf16":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


# Normalisation layers keep fp32 parameters under a bf16 policy (units of their own): a
# residual sum of fp32 and bf16 activations is fp32, and the CPU's layer_norm refuses an
# fp32 input with bf16 weights (autocast does not cast them there); statistics need fp32 anyway.
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_FP32 = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_layers(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """FSDP2 on each of the model's units that has parameters, then on the whole model (the rest)."""
    policy = {"mp_policy": mp_policy} if mp_policy is not None else {}
    if mp_policy is not None and mp_policy.param_dtype is not None:
        for norm in [m for m in model.modules() if isinstance(m, _NORMS)]:
            if any(True for _ in norm.parameters()):
                fully_shard(norm, mesh=mesh, mp_policy=_FP32)
    for unit in fsdp_units(model):
        if any(True for _ in unit.parameters()):
            fully_shard(unit, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)


def build_sharded(build: ModelBuilder, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, rank: int,
                  device: torch.device) -> nn.Module:
    """The plain model `build` makes, sharded, with no rank but rank 0 ever holding it whole,
    and rank 0 only its weights, in host memory, before any gradient or optimizer state
    exists (as Accelerate's cpu_ram_efficient_loading and torchtitan's seed checkpoint do).

    Every rank builds it on the meta device (shapes, no storage), shards it and allocates
    its own shards (`to_empty`). The values must be the seeded plain model's, which a
    re-initialisation of the shards (reset_parameters under the seed) would not give: the
    seed's stream is drawn in the factory's order over whole tensors. So rank 0 builds the
    plain model for real on the CPU, and torch's state-dict API broadcasts it one tensor at
    a time, each rank keeping its slice; then rank 0 drops it. Buffers left out of the
    state dict (persistent=False) are broadcast the same way. Collective."""
    with torch.device("meta"):
        model = build()
    shard_layers(model, mesh, mp_policy)
    model.to_empty(device=device)
    plain = build() if rank == 0 else None
    set_model_state_dict(model, plain.state_dict() if plain is not None else {}, options=_FROM_RANK0)
    saved = set(model.state_dict())
    plain_buffers = dict(plain.named_buffers()) if plain is not None else {}
    for name, buf in model.named_buffers():
        if name not in saved:
            if plain is not None:
                buf.copy_(plain_buffers[name])
            collectives.broadcast(buf, src=0)
    # Every rank's generator as if it had built the plain model (rank 0's, which did): a
    # model that draws in its forward (dropout) starts from where single-process training would.
    torch.set_rng_state(collectives.all_gather_object(torch.get_rng_state() if rank == 0 else None)[0])
    return model


class FullyShardedDataParallel(Strategy):
    name = "fsdp"
    settings: FsdpSettings
    mesh: Mesh
    # setup takes a ModelBuilder (Strategy.model_for): the model is built sharded.
    builds_model = True

    def __init__(self, cfg: TrainingConfig):
        # Every rank reads its own part of each batch, whatever the replicas and shards.
        super().__init__(cfg.fsdp, mesh_for(cfg, "dp_shard"), cfg.world_size)

    def check(self, cfg: TrainingConfig, model: nn.Module, inputs: ModelInputs | None = None) -> None:
        if cfg.batch_size % cfg.world_size:
            raise ConfigError(
                f"training.batch_size {cfg.batch_size} must be a multiple of "
                f"training.world_size {cfg.world_size} (fsdp: every rank reads its part)"
            )

    def shard_mesh(self, device: torch.device) -> DeviceMesh:
        """dp 1: plain FSDP over the shard dimension; dp > 1: HSDP (replicate x shard). Collective."""
        dm = self.mesh.device_mesh(device)
        return dm if self.mesh.dp > 1 else dm["dp_shard"]

    def prepare_module(self, model: nn.Module, cfg: TrainingConfig, world_size: int,
                       device: torch.device) -> nn.Module:
        shard_layers(model.to(device), self.shard_mesh(device), mixed_precision(cfg))
        return model

    def setup(
        self, model: nn.Module | ModelBuilder, cfg: TrainingConfig, rank: int, world_size: int,
        device: torch.device, make_optimizer: OptimizerFactory,
    ) -> ShardedRank:
        shard_mesh = self.shard_mesh(device)
        policy = mixed_precision(cfg)
        if isinstance(model, nn.Module):  # built already (every rank holds it): sharded in place
            shard_layers(model, shard_mesh, policy)
        else:
            model = build_sharded(model, shard_mesh, policy, rank, device)
        # Every rank reports and evaluates its part: evaluation runs the sharded model.
        return ShardedRank(model, cfg, device, make_optimizer, data_rank=rank, data_world=world_size,
                           reports=True, evaluates_sharded=True)


class ShardedRank(Parallel):
    """One rank of a model whose parameters are DTensors (FSDP2, DTensor tensor parallel
    or both): torch's state-dict API gives the plain model's tensors, and DCP its shards."""

    def __init__(self, model: nn.Module, cfg: TrainingConfig, device: torch.device,
                 make_optimizer: OptimizerFactory, *, data_rank: int, data_world: int, reports: bool,
                 evaluates_sharded: bool = False):
        self.model = model
        self.optimizer = make_optimizer(model.parameters())
        self.autocast = autocast_for(device, cfg)
        self.loss = loss_for(cfg)
        self.data_rank, self.data_world, self.reports = data_rank, data_world, reports
        # True: every rank runs forward_eval on its part of the validation split, in
        # lockstep (the forward gathers layers), and no plain model is built for it.
        self.evaluates_sharded = evaluates_sharded

    def step(self, x, y):
        self.model.train()
        out = train_step(self.model, self.optimizer, self.autocast, x, y, self.loss)
        return out if self.reports else None

    @torch.no_grad()
    def forward_eval(self, x) -> torch.Tensor:
        """The sharded model's outputs (fp32) on a batch's inputs (features or named tensors),
        in the training precision. Collective: every rank of the mesh calls it equally often."""
        self.model.eval()
        with self.autocast:
            return forward(self.model, x).float()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=_FULL)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's weights on rank 0, in host memory; {} on the other ranks. Collective."""
        return get_model_state_dict(self.model, options=_EXPORT)

    # Checkpoints (Parallel.checkpoint_parts): each rank writes and reads its own shards
    # through torch's state-dict API.

    def epoch_metrics(self) -> dict[str, float]:
        # The collectives run inside torch (FSDP2, DTensor): no figures of our own.
        return {}
