"""A model's parallel plans, declared by the model itself (as torchtitan keeps them beside
each model). A strategy asks for the plan it needs and refuses, in one line before any
process starts, a model that declares none. Every method is optional:

- `tp_plan() -> dict[str, "colwise" | "rowwise"]`: strategy tensor. Module path (as in
  `named_modules()`) of each Linear to split: colwise splits its output features,
  rowwise its input features (the partial outputs are summed). Each run of colwise
  layers must be closed by a rowwise one with only elementwise (or per-head) work
  between. `training.tp_plan` overrides it.
- `pipeline_layers() -> list[str]`: strategy pipeline. Names of the model's direct
  children in the order its forward runs them, each taking the previous one's output
  (the first takes the model's inputs as its forward does: the features tensor, or the
  named tensors of a dataset with tensor or image columns as keyword arguments,
  `first(image=..., grid=...)`; the last returns the model's output); they must hold every
  parameter and buffer, and only the first may take more than one tensor. An
  `nn.Sequential` needs none: its children are its layers (features datasets only: a
  Sequential takes no keyword arguments).
- `fsdp_units() -> list[nn.Module]`: strategy fsdp. Submodules sharded as units of their
  own (each gathered just before it runs, freed after); the rest goes with the root.
  Default: an `nn.Sequential`'s children that have parameters, else the whole model as one unit.
- `recompute_units() -> list[nn.Module]`: training.activation_checkpointing. Submodules
  whose activations are recomputed in backward. Default: `fsdp_units()` if declared.
"""

from __future__ import annotations

from torch import nn

from shardline.foundation.errors import ConfigError

STYLES = ("colwise", "rowwise")


def _declared(model: nn.Module, name: str):
    """The model's `name()` (or a plain attribute of that name); None if it has none."""
    own = getattr(model, name, None)
    if own is None:
        return None
    return own() if callable(own) else own


def tp_plan(model: nn.Module, what: str) -> dict[str, str] | None:
    """The model's own tensor-parallel plan; None if it declares none. `what` names it in errors."""
    plan = _declared(model, "tp_plan")
    if plan is None:
        return None
    if not isinstance(plan, dict) or any(s not in STYLES for s in plan.values()):
        raise ConfigError(f"{what}: tp_plan() must return {{module path: 'colwise' or 'rowwise'}}, got {plan!r}")
    return dict(plan)


def pipeline_layers(model: nn.Module, what: str) -> list[tuple[str, nn.Module]] | None:
    """(name, child) in the order a pipeline cuts them into stages; None if the model
    neither is an nn.Sequential nor declares pipeline_layers()."""
    names = _declared(model, "pipeline_layers")
    if names is None:
        if isinstance(model, nn.Sequential):
            return list(model.named_children())
        return None
    children = dict(model.named_children())
    if not isinstance(names, (list, tuple)) or not names:
        raise ConfigError(f"{what}: pipeline_layers() must return the names of its child modules, got {names!r}")
    missing = [n for n in names if n not in children]
    if missing:
        raise ConfigError(
            f"{what}: pipeline_layers() names '{missing[0]}', which is not a direct child module "
            f"(its children: {', '.join(children)})"
        )
    layers = [(n, children[n]) for n in names]
    covered = {f"{n}.{k}" for n, m in layers for k in m.state_dict()}
    left = [k for k in model.state_dict() if k not in covered]
    if left:
        raise ConfigError(
            f"{what}: pipeline_layers() leaves out {left[0]} (every parameter and buffer must be in a layer)"
        )
    return layers


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP shards as units of their own (before the root)."""
    units = _declared(model, "fsdp_units")
    if units is not None:
        return list(units)
    if isinstance(model, nn.Sequential):
        return [layer for layer in model if any(True for _ in layer.parameters())]
    return []


def recompute_units(model: nn.Module) -> list[nn.Module] | None:
    """The submodules activation checkpointing recomputes; None if the model declares none."""
    units = _declared(model, "recompute_units")
    if units is None:
        units = _declared(model, "fsdp_units")
    return None if units is None else list(units)
