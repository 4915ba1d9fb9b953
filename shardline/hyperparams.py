"""The training settings both estimators take as parameters of their own: what a user
tunes with scikit-learn's GridSearchCV or pyspark.ml's ParamGridBuilder and
CrossValidator, as with any estimator of theirs (`GridSearchCV(est, {"lr": [1e-3, 3e-3]})`).

Each is `training.<name>`; None (the default) leaves the config's value. A value given
both as a parameter and in `overrides` is refused (one place per setting); a parameter
over the config file is what a search does, so it wins. Settings that change how a run
is executed but not what it learns (world_size, launcher, checkpoints) stay in the
config: every strategy is numerically single-process training, `strategy` is here for a
search over models too big for one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardline.foundation.errors import ConfigError


@dataclass(frozen=True)
class Tuned:
    name: str  # the scikit-learn parameter and the setting's field: training.<name>
    spark: str  # the pyspark.ml Param's name (camelCase, as pyspark.ml's own)
    doc: str


TUNED = (
    Tuned("model", "model", "the model factory: a built-in name or 'pkg.module:factory'"),
    Tuned("model_args", "modelArgs", "keyword arguments of the model factory (a dict)"),
    Tuned("hidden", "hidden", "hidden widths of the built-in models (a list of ints)"),
    Tuned("strategy", "strategy", "the parallel strategy (ddp, fsdp, tensor, pipeline, ps)"),
    Tuned("epochs", "epochs", "passes over the train split"),
    Tuned("batch_size", "batchSize", "global batch size, split over the ranks"),
    Tuned("lr", "lr", "the learning rate for batch_size"),
    Tuned("weight_decay", "weightDecay", "AdamW weight decay"),
    Tuned("lr_schedule", "lrSchedule", "constant, cosine or step after warmup"),
    Tuned("warmup_steps", "warmupSteps", "linear warmup steps"),
    Tuned("seed", "seed", "seeds the weights, shuffling and dropout"),
)


def with_tuned(cfg, values: Mapping[str, Any], overrides: Iterable[str] | Mapping[str, Any],
               spark: bool = False):
    """cfg (a ShardlineConfig) with the tuned parameters given (not None) as its training
    settings. values: by Tuned.name; spark: name the parameters as the Spark estimator does
    in a refusal."""
    from shardline.config import load_config

    named = _named_settings(overrides)
    settings, param = {}, {}
    for t in TUNED:
        value = values.get(t.name)
        if value is None:
            continue
        setting, shown = f"training.{t.name}", t.spark if spark else t.name
        if any(n == setting or n.startswith(f"{setting}.") for n in named):
            raise ConfigError(f"{shown} = {value!r} and overrides set {setting} too: give it once "
                              "(the parameter, to search over it)")
        settings[setting], param[setting] = value, shown
    if not settings:
        return cfg
    try:
        return load_config(cfg, settings)
    except ConfigError as e:  # "overrides['training.lr']: training.lr: Input should be greater than 0 (got -1)"
        setting, _, why = str(e).partition(": ")[2].partition(": ")  # after who set it: the setting, why
        if setting not in param:
            raise
        raise ConfigError(f"{param[setting]} = {settings[setting]!r}: {why}") from None


def _named_settings(overrides: Iterable[str] | Mapping[str, Any]) -> set[str]:
    """The settings `overrides` writes ('section.field=value' strings or a mapping)."""
    if isinstance(overrides, Mapping):
        return {str(k).strip() for k in overrides}
    if isinstance(overrides, str):
        overrides = [overrides]
    return {str(item).partition("=")[0].strip() for item in overrides}
