"""The driver's checks of the user's model, loss and metrics, before any process starts.

Without the dataset (`check_callables`): each import path imports and names a callable
that takes what it will be given. With it (`check_model`): one forward pass of the built
model on a two-row batch of the dataset's shape (zeros: the features tensor, or each
named tensor in its dtype and shape, training.batch), whose output must be [batch, classes]
(regression: [batch, 1] or [batch]), then the loss and each metric on that output. A
mistake found here is one line naming the setting; found in a rank, it would be a failed
job after the engine, the ranks and the MLflow run had started.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from shardline.foundation.errors import ConfigError, first_line

from ..batch import describe, forward
from ..config import TrainingConfig
from ..launchers.rank_errors import user_frame
from ..loop.function import resolve as resolve_loop
from .factory import factory_path, load_factory
from .inputs import ModelInputs
from .plans import recompute_units
from ..user_code import import_user_object
from ..task import TASKS, loss_for, metric_names, user_metric_names, user_metrics


def _takes_output_and_target(fn, setting: str, path: str) -> None:
    if not callable(fn):
        raise ConfigError(f"{setting}: {path} is not callable (it is a {type(fn).__name__})")
    try:
        inspect.signature(fn).bind(None, None)
    except ValueError:  # no signature to read (some builtins): the sample call tells
        return
    except TypeError as e:
        raise ConfigError(f"{setting}: {path} must take (output, target) ({e})") from None


def check_callables(cfg: TrainingConfig, loop_resolved: bool = False) -> None:
    """training.model, loop, loss and metrics import and take their arguments (no dataset
    needed). loop_resolved: the job's loop was resolved and checked already (a function
    given to the API, which may be importable by no path)."""
    load_factory(cfg)
    if cfg.loop is not None and not loop_resolved:
        resolve_loop(cfg)  # imports, and takes one argument: the loop context
    if cfg.loss is not None:
        _takes_output_and_target(loss_for(cfg), "training.loss", cfg.loss)
    names = user_metric_names(cfg)
    taken = set()
    for kind in TASKS:
        taken.update(metric_names(kind, "val"))
    for i, (name, path) in enumerate(zip(names, cfg.metrics)):
        setting = f"training.metrics[{i}]"
        if name in taken or name in names[:i]:
            raise ConfigError(f"{setting}: {path} would be logged as {name}, which another metric is")
        _takes_output_and_target(import_user_object(path, setting, cfg.code_paths), setting, path)


def check_model(cfg: TrainingConfig, inputs: ModelInputs, model: nn.Module) -> None:
    """The built model, the loss and the metrics on a sample batch of the dataset's shape."""
    what = f"training.model {factory_path(cfg)}"
    x, y = inputs.sample_batch(2)
    model.eval()  # a batch of zeros: no running statistics updated, no dropout
    try:
        out = forward(model, x)  # the features tensor, or the named tensors as keywords
    except Exception as e:  # noqa: BLE001 - the user's forward: its message is theirs to see
        how = " as keyword arguments" if inputs.named else ""
        raise ConfigError(
            f"{what}: its forward fails on a batch of the dataset's shape ({describe(x)}{how}) "
            f"with {first_line(e, with_type=True)}{_at(e)}"
        ) from None
    _check_output(what, inputs, out)
    if cfg.loss is not None:
        _check_loss(cfg, out, y)
    for i, (name, fn) in enumerate(user_metrics(cfg).items()):
        with torch.no_grad():
            value = _call(fn, f"training.metrics[{i}]", cfg.metrics[i], out.detach(), y)
        try:
            float(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"training.metrics[{i}]: {cfg.metrics[i]} returned a {type(value).__name__}, not a number"
            ) from None
    if cfg.activation_checkpointing and recompute_units(model) is None:
        raise ConfigError(
            f"training.activation_checkpointing: {what} declares no recompute_units() or fsdp_units() "
            "(the submodules to recompute)"
        )


def _check_output(what: str, inputs: ModelInputs, out) -> None:
    k = inputs.output_width
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"{what}: its forward returns a {type(out).__name__}, not a tensor [batch, {k}]")
    shape = list(out.shape)
    if inputs.task == "next_token":  # a logit per token id at every position
        want = [2, *inputs.label.shape, k]
        if shape != want:
            raise ConfigError(
                f"{what}: its output for a batch of 2 rows is {shape}, but the dataset's task is next_token "
                f"over {k} token ids: the output must be [batch, {inputs.label.shape[0]}, {k}] "
                "(logits at every position)"
            )
        return
    ok = shape == [2, k] or (inputs.task == "regression" and shape == [2])
    if not ok:
        need = f"{k} classes" if inputs.task == "classification" else "regression (one value per row)"
        raise ConfigError(
            f"{what}: its output for a batch of 2 rows is {shape}, but the dataset's task is {need}: "
            f"the output must be [batch, {k}]"
        )


def _call(fn, setting: str, path: str, out, y):
    try:
        return fn(out, y)
    except Exception as e:  # noqa: BLE001 - the user's function: its message is theirs to see
        raise ConfigError(
            f"{setting}: {path} fails on the model's output for a batch of the dataset's shape "
            f"with {first_line(e, with_type=True)}{_at(e)}"
        ) from None


def _at(e: BaseException) -> str:
    """Where the user's code raised `e`, as a rank's failure line says it: " (at
    mynets/nets.py, line 12, in forward)" (launchers.rank_errors.user_frame)."""
    where = user_frame(e, users_only=True)  # a TypeError of the call itself is torch's frame: said without
    return f" (at {where})" if where else ""


def _check_loss(cfg: TrainingConfig, out: torch.Tensor, y: torch.Tensor) -> None:
    loss = _call(loss_for(cfg), "training.loss", cfg.loss, out, y)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise ConfigError(f"training.loss: {cfg.loss} returned {got}, not a scalar tensor")
    if out.requires_grad and not loss.requires_grad:
        raise ConfigError(
            f"training.loss: {cfg.loss} returned a tensor with no gradient to the model's output "
            "(computed outside torch, or detached): the model would not train"
        )
