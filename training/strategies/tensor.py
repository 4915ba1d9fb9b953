"""Tensor parallel's plan, checked against the model before any process starts.

The plan (module path -> "colwise" / "rowwise") is the model's own (its `tp_plan()`,
training.models.plans) or `training.tensor.plan`; parallelize.py applies it on the mesh's tp
dimension with torch's `ColwiseParallel` (output features split, the input whole on every
rank) and `RowwiseParallel` (input features split, the partial outputs all-reduced).
Everything off the plan (embeddings, norms, heads, rowwise biases) stays whole and
replicated: after a rowwise all-reduce every tp rank sees the same activations, so those
weights get the same gradients everywhere and need no tp sync. With data dimensions, FSDP2
shards (or replicates) the split weights over them (torchtitan's 2-D layout): DDP cannot
take a DTensor model (`DDP(device_mesh=...)` turns its DTensor parameters into plain local
ones, after which torch's state-dict API drops them: torch 2.13, measured).
"""

from __future__ import annotations

from torch import nn

from shardline.foundation.errors import ConfigError

from ..config import TrainingConfig
from ..models.plans import tp_plan
from ..models.builtin import Attention, TabularMLP


def checked_plan(cfg: TrainingConfig, model: nn.Module, tp: int, what: str | None = None) -> dict[str, str]:
    """The plan the settings ask for, refused (one line naming the setting) unless it splits
    this model correctly over `tp` ranks. `what` names the model (default: training.model's)."""
    what = what or f"training.model {cfg.model}"
    if cfg.tensor.plan is not None:
        plan, setting = dict(cfg.tensor.plan), "training.tensor.plan"
    elif (own := tp_plan(model, what)) is not None:
        plan, setting = own, f"{what}'s plan"
    else:
        raise ConfigError(
            f"training.mesh.tp {tp}: {what} declares no tensor-parallel plan "
            "(a tp_plan() method: module path -> colwise/rowwise; built-in: mlp, transformer, decoder); "
            "or set training.tensor.plan"
        )
    if not plan:
        what = f"training.hidden {cfg.hidden} has" if isinstance(model, TabularMLP) else f"{setting} has"
        raise ConfigError(
            f"training.mesh.tp {tp}: {what} no pair of layers to split"
            + (" (the mlp needs at least 2 hidden widths)" if isinstance(model, TabularMLP) else "")
        )
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for path in plan:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            shown = ", ".join(list(linears)[:8]) + (", ..." if len(linears) > 8 else "")
            raise ConfigError(
                f"{setting}: module '{path}' is not in {what} (its Linear layers: {shown})"
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
                f"training.mesh.tp {tp} must divide training.heads {attn.heads} (and d_model {attn.q.in_features})"
            )
    _check_pairs(plan, linears, setting)
    for path, style in plan.items():
        linear = linears[path]
        width = linear.out_features if style == "colwise" else linear.in_features
        if width % tp:
            raise ConfigError(f"training.mesh.tp {tp} must divide {_width_name(model, path, style, width)}")
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
