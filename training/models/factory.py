"""The model of a job: `training.model` names a factory, built-in or the user's, all one way.

The protocol: `factory(inputs: ModelInputs, **training.model_args) -> nn.Module`
(training.models.inputs). `training.model` is an import path 'package.module:callable'
(a function or a class), or a built-in name, which stands for a path in
`shardline.training.models.builtin` plus default model_args read from the built-in settings
(training.hidden, heads, embedding_dim); training.model_args overrides them. The
module's parallel plans are its own methods (training.models.plans).

`build_model(manifest, cfg)` is the one entry point: the driver's checks, every rank,
evaluation, the registered model and the benchmarks build through it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from shardline.foundation.errors import ConfigError, first_line
from shardline.pipelines.manifest import ShardManifest

from ..config import TrainingConfig
from .inputs import ModelInputs
from ..user_code import import_user_object, is_import_path

# Built-in name -> (its factory's import path, the settings it takes as default model_args).
BUILTINS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp": ("shardline.training.models.builtin:mlp", ("hidden", "embedding_dim")),
    "cnn": ("shardline.training.models.builtin:cnn", ("hidden",)),
    "transformer": ("shardline.training.models.builtin:transformer", ("hidden", "heads")),
    "decoder": ("shardline.training.models.decoder:decoder", ("hidden", "heads")),
}


def factory_path(cfg: TrainingConfig) -> str:
    """The import path `training.model` stands for; one line if it is neither kind."""
    if cfg.model in BUILTINS:
        return BUILTINS[cfg.model][0]
    if not is_import_path(cfg.model):
        raise ConfigError(
            f"training.model: unknown model '{cfg.model}' (valid: {', '.join(sorted(BUILTINS))}); "
            "or name your own factory as 'package.module:callable'"
        )
    return cfg.model


def factory_args(cfg: TrainingConfig) -> dict:
    """The keyword arguments the factory gets: a built-in's settings, then training.model_args."""
    defaults = {s: getattr(cfg, s) for s in BUILTINS[cfg.model][1]} if cfg.model in BUILTINS else {}
    return {**defaults, **cfg.model_args}


def load_factory(cfg: TrainingConfig) -> Callable[..., nn.Module]:
    """The factory, imported (the cwd and training.code_paths on sys.path) and checked
    callable with (inputs, **model_args): what can be told without the dataset."""
    path = factory_path(cfg)
    factory = import_user_object(path, "training.model", cfg.code_paths)
    if not callable(factory):
        raise ConfigError(f"training.model: {path} is not callable (it is a {type(factory).__name__})")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have none: the call will tell
        return factory
    try:
        signature.bind(None, **factory_args(cfg))
    except TypeError as e:
        raise ConfigError(
            f"training.model_args: {path} does not take them as factory(inputs, **model_args) ({e})"
        ) from None
    return factory


def create_model(inputs: ModelInputs, cfg: TrainingConfig) -> nn.Module:
    """The factory's module for `inputs`, seeded so every rank starts equal."""
    factory = load_factory(cfg)
    return _call(factory, factory_path(cfg), inputs, factory_args(cfg), cfg.model_args, cfg.seed)


def _call(factory, path: str, inputs: ModelInputs, args: dict, shown_args: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    try:
        model = factory(inputs, **args)
    except ConfigError:
        raise  # a built-in's own check names its setting
    except Exception as e:  # noqa: BLE001 - the user's factory: its message is theirs to see
        shown = f" with training.model_args {shown_args}" if shown_args else ""
        raise ConfigError(f"training.model: {path}{shown} raised {first_line(e, with_type=True)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"training.model: {path} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(manifest: ShardManifest, cfg: TrainingConfig) -> nn.Module:
    """Build `cfg.model` for the dataset's shape, seeded so every rank starts equal."""
    return create_model(ModelInputs.from_manifest(manifest), cfg)
