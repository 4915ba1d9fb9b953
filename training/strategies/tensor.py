"""Tensor parallel on DTensor: the planned Linear layers split over the tp ranks of a DeviceMesh.

The plan (module path -> "colwise" / "rowwise") is the model's own (its `tp_plan()`,
training.models.plans) or `training.tp_plan`; torch's `parallelize_module`
applies it with `ColwiseParallel` (output features split, the input whole on every
rank) and `RowwiseParallel` (input features split, the partial outputs all-reduced).
Everything off the plan (embeddings, norms, heads, rowwise biases) stays whole and
replicated: after a rowwise all-reduce every tp rank sees the same activations, so
those weights get the same gradients everywhere and need no tp sync.

dp x tp: the 2-D mesh's dp dimension is sharded with FSDP2 on top of the split
(torchtitan's 2-D layout), so each replica rank holds 1/dp of its tp shard. DDP
cannot take a DTensor model here: `DDP(device_mesh=...)` turns its DTensor parameters
into plain local ones, after which torch's state-dict API drops them (torch 2.13,
measured), and checkpoints and evaluation need that API.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardline.foundation.errors import ConfigError

from ..config import TrainingConfig
from ..models.inputs import ModelInputs
from ..models.plans import tp_plan
from ..models.builtin import Attention, TabularMLP
from ..strategy_settings import TensorSettings
from .base import Mesh, OptimizerFactory, Strategy, mesh_for
from .fsdp import ShardedRank, shard_layers

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def checked_plan(cfg: TrainingConfig, settings: TensorSettings, model: nn.Module, tp: int,
                 what: str | None = None) -> dict[str, str]:
    """The plan the settings ask for, refused (one line naming the setting) unless it splits
    this model correctly over `tp` ranks. `what` names the model (default: training.model's)."""
    what = what or f"training.model {cfg.model}"
    if settings.plan is not None:
        plan, setting = dict(settings.plan), "training.tp_plan"
    elif (own := tp_plan(model, what)) is not None:
        plan, setting = own, f"{what}'s plan"
    else:
        raise ConfigError(
            f"training.strategy tensor: {what} declares no tensor-parallel plan "
            "(a tp_plan() method: module path -> colwise/rowwise; built-in: mlp, transformer); "
            "or set training.tp_plan"
        )
    if not plan:
        what = f"training.hidden {cfg.hidden} has" if isinstance(model, TabularMLP) else f"{setting} has"
        raise ConfigError(
            f"training.strategy tensor: {what} no pair of layers to split"
            + (" (the mlp needs at least 2 hidden widths)" if isinstance(model, TabularMLP) else "")
        )
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for path in plan:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            shown = ", ".join(list(linears)[:8]) + (", ..." if len(linears) > 8 else "")
            raise ConfigError(
                f"{setting}: module '{path}' is not in training.model {cfg.model} (its Linear layers: {shown})"
            ) from None
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"{setting}: '{path}' is a {type(module).__name__}, not a Linear (tensor parallel splits Linear layers)"
            )
    for name, attn in ((n, m) for n, m in model.named_modules() if isinstance(m, Attention)):
        styles = [plan.get(f"{name}.{p}") for p in ("q", "k", "v", "out")]
        if styles not in ([None] * 4, ["colwise"] * 3 + ["rowwise"]):
            raise ConfigError(
                f"{setting}: attention '{name}' splits q, k and v colwise and out rowwise, or none of them"
            )
        if styles[0] and attn.heads % tp:
            raise ConfigError(
                f"training.tp {tp} must divide training.heads {attn.heads} (and d_model {attn.q.in_features})"
            )
    _check_pairs(plan, linears, setting)
    for path, style in plan.items():
        linear = linears[path]
        width = linear.out_features if style == "colwise" else linear.in_features
        if width % tp:
            raise ConfigError(f"training.tp {tp} must divide {_width_name(model, path, style, width)}")
    return plan


def _check_pairs(plan: dict[str, str], linears: dict[str, nn.Linear], setting: str) -> None:
    """In the model's order of Linear layers (its data flow, for these Sequentials), each
    run of colwise layers is closed by a rowwise one, and no whole Linear sits between:
    a rowwise layer takes split input, anything else whole input."""
    opened = None
    for name in linears:
        style = plan.get(name)
        if style == "colwise":
            opened = opened or name
        elif style == "rowwise":
            if opened is None:
                raise ConfigError(
                    f"{setting}: rowwise '{name}' follows no colwise layer (a rowwise layer takes "
                    "the split output of colwise ones)"
                )
            opened = None
        elif opened is not None:
            raise ConfigError(
                f"{setting}: '{name}' lies between colwise '{opened}' and its rowwise layer but "
                "is not split (it would get a split input)"
            )
    if opened is not None:
        raise ConfigError(f"{setting}: colwise '{opened}' is closed by no rowwise layer (its output would stay split)")


def _width_name(model: nn.Module, path: str, style: str, width: int) -> str:
    """The setting that makes a split width: hidden[i] for an mlp's Dense i+1."""
    layer, _, rest = path.partition(".")
    if isinstance(model, TabularMLP) and rest == "linear" and style == "colwise":
        return f"training.hidden[{int(layer) - 1}] {width}"
    side = "output" if style == "colwise" else "input"
    return f"the {width} {side} features of {style} '{path}'"


class TensorParallel(Strategy):
    name = "tensor"
    settings: TensorSettings
    mesh: Mesh

    def __init__(self, cfg: TrainingConfig):
        mesh = mesh_for(cfg, "tp")
        # The tp ranks of a replica read the same batch: each replica is one data part.
        super().__init__(cfg.tensor, mesh, mesh.dp)

    def check(self, cfg: TrainingConfig, model: nn.Module, inputs: ModelInputs | None = None) -> None:
        checked_plan(cfg, self.settings, model, self.mesh.inner)
        if cfg.batch_size % self.mesh.dp:
            raise ConfigError(
                f"training.batch_size {cfg.batch_size} must be a multiple of training.dp {self.mesh.dp}"
            )

    def prepare_module(self, model: nn.Module, cfg: TrainingConfig, world_size: int,
                       device: torch.device) -> nn.Module:
        return self._split(model.to(device), cfg, device, f"ctx.prepare: {type(model).__name__}")

    def _split(self, model: nn.Module, cfg: TrainingConfig, device: torch.device, what: str | None = None):
        """The plan applied over the tp dimension, then FSDP2 over dp (dp > 1). Collective."""
        mesh = self.mesh
        dm = mesh.device_mesh(device)
        plan = checked_plan(cfg, self.settings, model, mesh.inner, what)
        parallelize_module(model, dm["tp"], {path: STYLES[style]() for path, style in plan.items()})
        if mesh.dp > 1:
            shard_layers(model, dm["dp"])
            # A weight sharded over both mesh dimensions takes two all-gathers to make whole
            # (evaluation, checkpoints), which torch logs as a warning at every gather.
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        return model

    def setup(
        self, model: nn.Module, cfg: TrainingConfig, rank: int, world_size: int,
        device: torch.device, make_optimizer: OptimizerFactory,
    ) -> ShardedRank:
        mesh = self.mesh
        self._split(model, cfg, device)
        # The tp ranks of a replica compute the same logits and loss: the first reports them.
        return ShardedRank(model, cfg, device, make_optimizer, data_rank=mesh.dp_index(rank),
                           data_world=mesh.dp, reports=mesh.inner_index(rank) == 0)
