"""Megatron-style tensor parallel: each layer's matrices split over the tp ranks of a mesh.

A plan (module path -> style) pairs a column-parallel Linear (output features
split; its input copied to every rank) with a row-parallel one (input features
split; the partial outputs all-reduced), so each pair costs one all-reduce
forward and one backward. Everything off the plan (embeddings, norms, heads,
row-parallel biases) is replicated: its inputs are identical on every tp rank
after the row-parallel all-reduce, so its gradients are too, and need no tp sync.
The mesh is dp x tp: dp replicas of the split model average their gradients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipelines.errors import ConfigError

from ..config import TrainingConfig
from ..task import task_loss
from ..models import Attention, Block, Dense, FeatureTransformer, TabularMLP
from .base import OptimizerFactory, autocast_for, average_gradients, mesh_for


class TPComm:
    """All-reduces over one tp group, with the time they take."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group = group
        self.seconds = 0.0
        # NCCL collectives return before they run: wait for the device on both sides,
        # so the figure is the all-reduce's own time, not a launch's or the compute's before it.
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return t
        self.sync()
        start = time.perf_counter()
        # A summed bf16 (autocast) would round at every hop: sum in float32, round once.
        total = t.to(torch.float32, copy=True)
        dist.all_reduce(total, group=self.group)
        self.sync()
        self.seconds += time.perf_counter() - start
        return total.to(t.dtype)


class _CopyToTP(torch.autograd.Function):
    """Column-parallel input: every rank uses all of x, so x's gradient is the sum of the ranks'."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad), None


class _ReduceFromTP(torch.autograd.Function):
    """Row-parallel output: the sum of the ranks' partial products; each rank's
    gradient is the whole output's (a sum passes its gradient to every term)."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a Linear: its slice of the output features (left sharded)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, comm: TPComm):
        super().__init__()
        self.weight, self.bias, self.comm = nn.Parameter(weight), nn.Parameter(bias), comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of a Linear, fed the sharded output of a column-parallel one."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, comm: TPComm):
        super().__init__()
        self.weight, self.bias, self.comm = nn.Parameter(weight), nn.Parameter(bias), comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.comm)
        # After the all-reduce: added once, not tp times (so replicated).
        return y + self.bias.to(y.dtype)


@dataclass(frozen=True)
class Colwise:
    """Split a Linear's output features (weight rows, bias)."""

    # Fused projections ([q | k | v]): split each part alike, so a rank gets whole heads of each.
    groups: int = 1
    module = ColumnParallelLinear

    def splits(self, name: str) -> bool:
        return True

    def shard(self, name: str, full: torch.Tensor, index: int, tp: int) -> torch.Tensor:
        return full.unflatten(0, (self.groups, -1)).chunk(tp, 1)[index].flatten(0, 1).clone()

    def unshard(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([s.unflatten(0, (self.groups, -1)) for s in shards], 1).flatten(0, 1)


@dataclass(frozen=True)
class Rowwise:
    """Split a Linear's input features (weight columns); the bias stays whole."""

    module = RowParallelLinear

    def splits(self, name: str) -> bool:
        return name == "weight"

    def shard(self, name: str, full: torch.Tensor, index: int, tp: int) -> torch.Tensor:
        return (full.chunk(tp, 1)[index] if self.splits(name) else full).clone()

    def unshard(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(shards, 1)


Style = Colwise | Rowwise


def plan_for(model: nn.Module) -> tuple[dict[str, Style], list[tuple[str, int]]] | None:
    """(module path -> style, the widths tp must divide as (setting, width)); None: no plan."""
    if isinstance(model, FeatureTransformer):
        blocks = [i for i, layer in enumerate(model) if isinstance(layer, Block)]
        plan = {
            f"{i}.{path}": style
            for i in blocks
            for path, style in (("attn.qkv", Colwise(3)), ("attn.out", Rowwise()),
                                ("ff1", Colwise()), ("ff2", Rowwise()))
        }
        attn = model[blocks[0]].attn
        # d_model = heads x head_dim and ff1 is 2 x d_model wide: tp | heads is enough.
        return plan, [(f"training.heads {attn.heads} (and d_model {attn.qkv.in_features})", attn.heads)]
    if isinstance(model, TabularMLP):
        dense = [i for i, layer in enumerate(model) if isinstance(layer, Dense)]
        # Consecutive pairs; an odd last Dense stays replicated (its input is whole).
        pairs = list(zip(dense[0::2], dense[1::2]))
        plan = {p: s for a, b in pairs for p, s in ((f"{a}.linear", Colwise()), (f"{b}.linear", Rowwise()))}
        # Layer i of the Sequential is hidden[i - 1] (layer 0 is the input).
        widths = [(f"training.hidden[{a - 1}] {model[a].linear.out_features}", model[a].linear.out_features)
                  for a, _ in pairs]
        return plan, widths
    return None


class TensorParallel:
    name = "tensor"

    def check(self, cfg: TrainingConfig, model: nn.Module) -> None:
        mesh = mesh_for(cfg, "tp")
        planned = plan_for(model)
        if planned is None:
            raise ConfigError(
                f"training.strategy tensor: training.model {cfg.model} has no tensor-parallel "
                "plan (tensor splits: mlp, transformer)"
            )
        if not planned[0]:
            raise ConfigError(
                f"training.strategy tensor: training.hidden {cfg.hidden} has no pair of layers "
                "to split (the mlp needs at least 2 hidden widths)"
            )
        for setting, width in planned[1]:
            if width % mesh.inner:
                raise ConfigError(f"training.tp {mesh.inner} must divide {setting}")
        if cfg.batch_size % mesh.dp:
            raise ConfigError(
                f"training.batch_size {cfg.batch_size} must be a multiple of training.dp {mesh.dp}"
            )

    def data_world(self, cfg: TrainingConfig) -> int:
        return mesh_for(cfg, "tp").dp

    def setup(
        self, model: nn.Module, cfg: TrainingConfig, rank: int, world_size: int,
        device: torch.device, make_optimizer: OptimizerFactory,
    ) -> TensorParallelRank:
        return TensorParallelRank(model, cfg, rank, device, make_optimizer)


class TensorParallelRank:
    def __init__(self, model, cfg, rank, device, make_optimizer):
        mesh = mesh_for(cfg, "tp")
        self.dp_group, tp_group = mesh.groups(rank)
        self.dp, self.tp, self.index = mesh.dp, mesh.inner, mesh.inner_index(rank)
        self.tp_group, self.comm = tp_group, TPComm(tp_group, device)
        self.plan = plan_for(model)[0]
        self.model = self._split(model)
        self.optimizer = make_optimizer(self.model.parameters())
        self.autocast = autocast_for(device, cfg)
        self.data_rank, self.data_world = mesh.dp_index(rank), mesh.dp
        self.reports = self.index == 0

    def _split(self, model: nn.Module) -> nn.Module:
        for path, style in self.plan.items():
            linear = model.get_submodule(path)
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, style.module(
                style.shard("weight", linear.weight.detach(), self.index, self.tp),
                style.shard("bias", linear.bias.detach(), self.index, self.tp),
                self.comm,
            ))
        # Each rank's qkv rows are whole heads (Colwise(3)): it attends with its share of them.
        for layer in model.modules():
            if isinstance(layer, Attention):
                layer.heads //= self.tp
        return model

    def _style(self, key: str) -> tuple[Style | None, str]:
        module, _, name = key.rpartition(".")
        return self.plan.get(module), name

    def step(self, x, y):
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast:
            logits = self.model(x)
            loss = task_loss(logits, y)
        loss.backward()
        average_gradients(list(self.model.parameters()), self.dp_group, self.dp)
        self.optimizer.step()
        return (logits, loss) if self.reports else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full = {}
        for key, value in self.model.state_dict().items():
            style, name = self._style(key)
            if style is not None and style.splits(name) and self.tp_group is not None:
                shards = [torch.empty_like(value) for _ in range(self.tp)]
                dist.all_gather(shards, value.contiguous(), group=self.tp_group)
                value = style.unshard(name, shards)
            full[key] = value
        return full

    def state_dict(self) -> dict:
        # Weights come back through full_state_dict(); the optimizer state is this rank's shard's.
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict, full: dict[str, torch.Tensor]) -> None:
        sharded = {}
        for key, value in full.items():
            style, name = self._style(key)
            sharded[key] = value if style is None else style.shard(name, value, self.index, self.tp)
        self.model.load_state_dict(sharded)
        self.optimizer.load_state_dict(state["optimizer"])

    def epoch_metrics(self) -> dict[str, float]:
        # Time in tp all-reduces (forward and backward; recomputed ones too), waiting for
        # the slowest tp peer included: what splitting the layers costs this rank.
        ms, self.comm.seconds = self.comm.seconds * 1e3, 0.0
        return {"tp_allreduce_ms": ms}
