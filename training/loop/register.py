"""ctx.register and ctx.build_model: a loop's model becomes the job's registered model.

The ranks only gather it: rank 0 receives the plain model's weights (a sharded model's a
tensor at a time, as a strategy's export does), checks that what will rebuild it does, and
hands both to the driver in its result. The driver logs and registers it when the ranks
are done (training.job), in the format of every registered model (training.models.files):
safetensors weights, the job's code, and the import path and arguments that rebuild the
module, so loading never unpickles.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardline.foundation.errors import ConfigError, first_line

from ..batch import Inputs
from ..models.factory import build_model
from ..strategies.base import Parallel
from ..user_code import import_user_object, package_location
from .io import describe_io

if TYPE_CHECKING:
    from .context import LoopContext


def build_job_model(ctx: LoopContext) -> nn.Module:
    """ctx.build_model: training.model for the dataset, seeded; remembered as the job's model."""
    model = build_model(ctx._manifest, ctx.config)
    ctx._job_models.add(id(model))
    return model


def register_model(ctx: LoopContext, model, example: Inputs | None, factory, args: dict | None) -> None:
    """ctx.register (see its docstring). Collective: every rank helps gather the weights."""
    if ctx._registering:
        raise ConfigError("ctx.register: called twice: a job registers one model (tracking.registered_model)")
    ctx._registering = True
    weights, plain, job_model = gathered_weights(ctx, model)
    if ctx.rank != 0:
        return
    path, args = factory_of(ctx, plain, factory, args, job_model)
    # The job's model needs no check (training.model builds it) unless an example is to run on it.
    rebuilt = rebuild(ctx, path, args, weights) if path is not None or example is not None else None
    ctx.registered = {"weights": weights, "factory": path, "args": args, **describe_io(ctx.inputs, rebuilt, example)}


def gathered_weights(ctx: LoopContext, model) -> tuple[dict[str, torch.Tensor], nn.Module | None, bool]:
    """(the plain model's weights on rank 0, in host memory ({} elsewhere); the plain module
    where this rank has one; whether it is the job's model). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    if isinstance(model, Parallel):
        return model.export_state_dict(), None, id(model) in ctx._job_models
    if not isinstance(model, nn.Module):
        raise ConfigError(f"ctx.register: takes an nn.Module or a ctx.parallel(...), not a {type(model).__name__}")
    plain = ctx._plain.get(id(model), model)
    plain = getattr(plain, "module", plain) if isinstance(plain, nn.parallel.DistributedDataParallel) else plain
    job_model = id(plain) in ctx._job_models
    if any(isinstance(p, DTensor) for p in model.parameters()):
        # Sharded (fsdp, tensor): each tensor gathered, copied to rank 0's host memory and
        # dropped on the others before the next one: no rank ever holds the whole model on its device.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options), plain, job_model
    # Every rank holds the weights (a replica): rank 0 copies its own, nothing travels.
    weights = {k: v.detach().cpu() for k, v in plain.state_dict().items()} if ctx.rank == 0 else {}
    return weights, plain, job_model


def factory_of(ctx: LoopContext, plain: nn.Module | None, factory, args: dict | None,
               job_model: bool) -> tuple[str | None, dict]:
    """(the import path that rebuilds the module, its keyword arguments); None: training.model's."""
    if factory is None and job_model:
        if args:
            raise ConfigError("ctx.register: args= goes with factory= or a model of your own class; the job's "
                              "model is rebuilt by training.model with training.model_args")
        return None, {}
    if factory is None:
        if plain is None:
            raise ConfigError("ctx.register: a Parallel of a model of your own needs factory= (what rebuilds it)")
        factory = own_class(plain)
    path = factory if isinstance(factory, str) else f"{getattr(factory, '__module__', '')}:" \
                                                     f"{getattr(factory, '__qualname__', '')}"
    module = path.partition(":")[0]
    if module in ("__main__", "__mp_main__", "") or "<" in path:
        raise ConfigError(
            f"ctx.register: the model's factory {path} is defined in {module or 'no module'}, which a scorer "
            "cannot import: define the class in a module of your package (training.code_paths), or pass factory="
        )
    top = module.split(".")[0]
    shipped = set(ctx.code.packages) if ctx.code else set()
    if top not in shipped and top != "shardline" and package_location(path) is not None:
        raise ConfigError(
            f"ctx.register: the model's factory {path} is in the package '{top}', which does not travel with "
            "the job: add its folder to training.code_paths"
        )
    return path, dict(args or {})


def own_class(module: nn.Module) -> type:
    """The module's own class: FSDP2 makes a sharded module an instance of a class of its
    own (FSDP<Name>, in torch.distributed) derived from it."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed"))


def rebuild(ctx: LoopContext, path: str | None, args: dict, weights: dict[str, torch.Tensor]) -> nn.Module:
    """The module the registered model will rebuild, with the weights loaded: refused in one
    line when it is not the model's (other state-dict keys or shapes)."""
    if path is None:
        with torch.random.fork_rng(devices=[]):
            module = build_model(ctx._manifest, ctx.config)
        module.load_state_dict(weights)
        return module.eval()
    module = call_factory(path, args, ctx.config.code_paths)
    theirs = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in weights.items()}
    if theirs != ours:
        missing = [k for k in ours if k not in theirs]
        extra = [k for k in theirs if k not in ours]
        shaped = [f"{k} {ours[k]} vs {theirs[k]}" for k in ours if k in theirs and ours[k] != theirs[k]]
        said = (f"it lacks '{missing[0]}'" if missing else f"it has '{extra[0]}' besides" if extra
                else f"shapes differ: {shaped[0]}")
        raise ConfigError(f"ctx.register: {path}(**{args}) does not rebuild the model ({said}): pass the "
                          "factory= and args= that build it")
    module.load_state_dict(weights)
    return module.eval()


def call_factory(path: str, args: dict, code_paths: list[str] = ()) -> nn.Module:
    """`path`(**args), seeded apart from the caller's generator; one line if it fails."""
    factory: Callable = import_user_object(path, "ctx.register factory", list(code_paths))
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as e:
        raise ConfigError(f"ctx.register: {path} does not take args {args} ({e})") from None
    except ValueError:  # no signature to read: the call tells
        pass
    with torch.random.fork_rng(devices=[]):
        try:
            module = factory(**args)
        except Exception as e:  # noqa: BLE001 - the user's factory: its message is theirs to see
            raise ConfigError(f"ctx.register: {path}(**{args}) raised {first_line(e, with_type=True)}") from None
    if not isinstance(module, nn.Module):
        raise ConfigError(f"ctx.register: {path}(**{args}) returned a {type(module).__name__}, not an nn.Module")
    return module

