"""Config owned by `training` for hyperparameter sweeps: the search space and how to search it."""

from __future__ import annotations

import json
from typing import Literal, get_origin

from pydantic import Field, ValidationError, field_validator, model_validator

from shardline.foundation.section import Section

from ..config import TrainingConfig, setting_field
from ..strategy_settings import TABLES

# Settings of the job around the model rather than of the model: never searched.
FIXED = {
    "launcher", "world_size", "checkpoint_dir", "resume", "keep_checkpoints", "max_restarts",
    "timeout_s", "log_every_steps", "checkpoint_every_steps", "threads_per_rank", "verify_shards",
}  # fmt: skip

Choice = str | int | float | bool | list[int]


def tunable() -> list[str]:
    # A sub-table's settings by their names under `training` ("pipeline.micro_batches",
    # `[sweep.space."pipeline.micro_batches"]` in TOML), as everywhere else.
    general = [n for n in TrainingConfig.model_fields if n not in FIXED and n not in TABLES]
    tables = [f"{t}.{f}" for t, model in TABLES.items() for f in model.model_fields]
    return sorted([*general, *tables])


def with_setting(settings: dict, name: str, value) -> dict:
    """Training settings (a dict, as model_dump gives) with `name` ("lr",
    "pipeline.micro_batches") set to `value`, its sub-table copied, not changed in place."""
    table, _, field = name.rpartition(".")
    if not table:
        return {**settings, name: value}
    return {**settings, table: {**settings.get(table, {}), field: value}}


class ParamSpace(Section):
    """One searched training setting: `[sweep.space.lr] type = "float", low = 1e-4, high = 0.1, log = true`."""

    type: Literal["float", "int", "categorical"] = Field(description="Kind of values searched.")
    low: float | None = Field(None, description="float/int: smallest value.")
    high: float | None = Field(None, description="float/int: largest value (inclusive).")
    log: bool = Field(False, description="float/int: sample on a log scale (bounds > 0).")
    step: float | None = Field(None, description="float/int: values are low + k*step.")
    choices: list[Choice] | None = Field(None, description="categorical: the values to try.")

    @model_validator(mode="after")
    def _consistent(self) -> ParamSpace:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("categorical needs a non-empty `choices` list")
            if self.low is not None or self.high is not None:
                raise ValueError("categorical takes `choices`, not low/high")
            if len({json.dumps(c) for c in self.choices}) < len(self.choices):
                raise ValueError("categorical `choices` has a value twice")
            return self
        if self.choices is not None:
            raise ValueError(f"{self.type} takes low/high, not `choices`")
        if self.low is None or self.high is None:
            raise ValueError(f"{self.type} needs both `low` and `high`")
        if self.low > self.high:
            raise ValueError(f"low {self.low:g} is greater than high {self.high:g}")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0 (got low {self.low:g})")
        if self.log and self.step is not None:
            raise ValueError("`log` and `step` cannot be used together")
        if self.step is not None and self.step <= 0:
            raise ValueError(f"step must be > 0 (got {self.step:g})")
        if self.type == "int":
            ints = [v for v in (self.low, self.high, self.step) if v is not None]
            if any(v != int(v) for v in ints):
                raise ValueError("int needs whole-number low, high and step")
        return self

    def values_to_check(self) -> list:
        """The values the search can reach at its edges: each must be a valid training setting."""
        if self.type == "categorical":
            return list(self.choices)
        cast = int if self.type == "int" else float
        return [cast(self.low), cast(self.high)]


class SweepConfig(Section):
    name: str = Field(
        "sweep",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="The sweep's name: the Optuna study and the MLflow parent run. Running "
        "again with the same name resumes it.",
    )
    space: dict[str, ParamSpace] = Field(
        default_factory=dict,
        description="Searched training settings, by name (training.<name>); see ParamSpace.",
    )
    objective: str = Field(
        "val_accuracy", description="Per-epoch training metric to optimise (its last epoch's value)."
    )
    direction: Literal["maximize", "minimize"] | None = Field(
        None, description="Default: minimize for *_loss, *_rmse, *_mae, *_perplexity and data_wait_fraction, "
        "else maximize.",
    )
    sampler: Literal["tpe", "random", "grid"] = Field(
        "tpe", description="tpe: Optuna's TPE; random; grid: every combination (floats need step)."
    )
    pruner: Literal["median", "halving", "hyperband", "none"] = Field(
        "median",
        description="Stops weak trials between epochs: median of earlier trials at the same "
        "epoch, successive halving, Hyperband, or none.",
    )
    pruner_startup_trials: int = Field(
        2, ge=0, description="median: no pruning until this many trials completed."
    )
    pruner_warmup_epochs: int = Field(
        1, ge=0, description="median: a trial is never pruned in its first N epochs."
    )
    trials: int = Field(
        8, ge=1, description="Trials in all, counting those a resumed sweep already ran."
    )
    parallel: int = Field(2, ge=1, description="Trials running at once.")
    engine: Literal["spark", "dask", "local"] | None = Field(
        None, description="Where trials run; default training.launcher."
    )
    world_size: int = Field(
        1, ge=1, description="Ranks per trial (training.world_size of each trial)."
    )
    seed: int = Field(0, description="Seeds the sampler.")
    storage: str | None = Field(
        None,
        description="Optuna storage URL (a sweep's trials must all reach it); default "
        "<stem>-optuna.db beside the tracking store's SQLite file <stem>.db (MLflow's own file "
        "cannot hold it: both keep an alembic_version table), else ./optuna.db.",
    )
    alias: str = Field("best", min_length=1, description="Registry alias given to the best trial's model.")

    @field_validator("space")
    @classmethod
    def _space_names(cls, space: dict[str, ParamSpace]) -> dict[str, ParamSpace]:
        names = tunable()
        for name, spec in space.items():
            if name not in names:
                raise ValueError(f"'{name}' is not a searchable training setting (valid: {', '.join(names)})")
            is_list = get_origin(setting_field(name).annotation) is list
            for value in spec.values_to_check():
                if isinstance(value, list) != is_list:
                    want = "a list" if is_list else "a single value"
                    raise ValueError(f"{name}: training.{name} takes {want}, got {value!r}")
                try:
                    TrainingConfig.model_validate(with_setting({}, name, value))
                except ValidationError as e:
                    msg = e.errors()[0]["msg"]
                    raise ValueError(f"{name}: {value!r} is not a valid training.{name} ({msg})") from None
        return space

    def resolved_direction(self) -> str:
        if self.direction:
            return self.direction
        lower_is_better = self.objective.endswith(("loss", "rmse", "mae", "perplexity")) or self.objective == "data_wait_fraction"
        return "minimize" if lower_is_better else "maximize"
