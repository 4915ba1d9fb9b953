"""Each parallel strategy's own settings: a sub-table of `[training]` per strategy.

`[training.pipeline] micro_batches = 8` is the setting's home. The flat names of earlier
versions (`training.micro_batches`, `training.pipeline_schedule`, `training.tp`, ...) stay
accepted wherever a config is given (TOML, `--set`, the API's overrides) and readable as
attributes of TrainingConfig: FLAT_NAMES maps each to its sub-table's field. Checkpoints'
fingerprints are keyed by the flat names, so they stay the same for the same settings.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from shardline.foundation.section import Section
from shardline.foundation.errors import ConfigError

# Imported inside the functions that use them: training.config (a cycle: it imports this module).


class DdpSettings(Section):
    """strategy ddp: every rank holds the whole model; gradients are all-reduced.
    Flat name accepted too: training.grad_compression."""

    grad_compression: Literal["none", "fp16"] = Field(
        "none", description="fp16: DDP all-reduces gradients in fp16 (half the bytes)."
    )


class FsdpSettings(Section):
    """strategy fsdp: parameters, gradients and optimizer state sharded (FSDP2; HSDP with
    training.dp > 1). Flat name accepted too: training.dp_shard."""

    dp_shard: int | None = Field(
        None, ge=1, description="Ranks each parameter, its gradient and optimizer state are "
        "sharded over; unset: world_size / dp (plain FSDP shards over every rank).",
    )


class TensorSettings(Section):
    """strategy tensor: planned Linear layers split over tp ranks (DTensor). Flat names
    accepted too: training.tp, training.tp_plan."""

    tp: int | None = Field(
        None, ge=1, description="Ranks each layer is split over; unset: world_size / dp.",
    )
    plan: dict[str, Literal["colwise", "rowwise"]] | None = Field(
        None, description="Module path -> colwise (output features split) or rowwise (input "
        "features split, outputs summed), each colwise run closed by a rowwise layer; unset: "
        "the model's own plan (its tp_plan(), training.models.plans).",
    )


class PipelineSettings(Section):
    """strategy pipeline: the model's layers cut into stages over pp ranks, run by a
    torch.distributed.pipelining schedule. Flat names accepted too: training.pp,
    training.pipeline_schedule, training.pipeline_stages_per_rank, training.micro_batches,
    training.pipeline_boundaries, training.pipeline_timing."""

    pp: int | None = Field(None, ge=1, description="Pipeline stages; unset: world_size / dp.")
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv"] = Field(
        "1f1b", description="gpipe runs all micro-batches forward, then all backward; 1f1b "
        "interleaves them (same bubble, at most pp micro-batches' activations held; needs "
        "micro_batches >= pp); interleaved-1f1b runs 1F1B over several stages per rank (a smaller "
        "bubble); zbv (zero bubble, V-shaped, 2 stages per rank) splits each backward into input "
        "and weight gradients and fills idle time with the latter.",
    )
    stages_per_rank: int | None = Field(
        None, ge=1, description="Model stages each rank holds (the model is cut into pp x this); "
        "unset: 1 for gpipe and 1f1b, 2 for interleaved-1f1b (any from 2) and zbv (exactly 2).",
    )
    micro_batches: int = Field(
        4, ge=1, description="Micro-batches per rank's batch (bubble (pp-1)/(m+pp-1)).",
    )
    boundaries: list[int] | None = Field(
        None, description="Index of the first layer of each stage after the first (pp x "
        "stages_per_rank - 1 increasing numbers); unset: stages balanced by parameter count.",
    )
    timing: bool = Field(
        False, description="Time every stage action and report the measured bubble "
        "(pipeline_bubble, _predicted, pipeline_cpu_wait, held activations) per epoch. Off by "
        "default: it waits for the device at every action, which on a GPU removes the overlap "
        "of compute and communication; `shardline bench strategies` turns it on.",
    )


class PsSettings(Section):
    """strategy ps: parameter servers. Flat names accepted too: training.ps_servers,
    training.ps_mode, training.ps_staleness."""

    servers: int = Field(
        1, ge=1, description="Ranks that hold the parameters (the last ones); the others are workers.",
    )
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync averages every worker's gradient into one update per step "
        "(= single-process SGD on the global batch); async applies each push at once.",
    )
    staleness: int = Field(
        2, ge=0, description="async: a worker may run at most this many steps ahead of the "
        "slowest worker (stale synchronous parallel); 0 is lockstep.",
    )


# training.<sub-table> -> its model; the sub-table's name is the strategy's.
TABLES: dict[str, type[Section]] = {
    "ddp": DdpSettings, "fsdp": FsdpSettings, "tensor": TensorSettings, "pipeline": PipelineSettings,
    "ps": PsSettings,
}

# Each earlier flat name -> (sub-table, field): accepted as input, readable as an attribute.
FLAT_NAMES: dict[str, tuple[str, str]] = {
    "grad_compression": ("ddp", "grad_compression"),
    "dp_shard": ("fsdp", "dp_shard"),
    "tp": ("tensor", "tp"),
    "tp_plan": ("tensor", "plan"),
    "pp": ("pipeline", "pp"),
    "pipeline_schedule": ("pipeline", "schedule"),
    "pipeline_stages_per_rank": ("pipeline", "stages_per_rank"),
    "micro_batches": ("pipeline", "micro_batches"),
    "pipeline_boundaries": ("pipeline", "boundaries"),
    "pipeline_timing": ("pipeline", "timing"),
    "ps_servers": ("ps", "servers"),
    "ps_mode": ("ps", "mode"),
    "ps_staleness": ("ps", "staleness"),
}


def nest_flat_names(data: Any) -> Any:
    """Raw training settings with every flat name moved into its sub-table; a flat name and
    its sub-table's field given with different values is refused in one line naming both."""
    if not isinstance(data, dict) or not any(k in FLAT_NAMES for k in data):
        return data
    data = dict(data)
    for name in [k for k in data if k in FLAT_NAMES]:
        table, field = FLAT_NAMES[name]
        value = data.pop(name)
        sub = data.get(table)
        if isinstance(sub, BaseModel):  # a settings object: what was set in it
            sub = sub.model_dump(exclude_unset=True)
        elif sub is None:
            sub = {}
        elif not isinstance(sub, dict):  # not a table: pydantic names it
            continue
        if field in sub and sub[field] != value:
            raise _twice(name, value, sub[field])
        data[table] = {**sub, field: value}
    return data


def _twice(name: str, flat: Any, nested: Any) -> ConfigError:
    table, field = FLAT_NAMES[name]
    return ConfigError(
        f"training.{name} = {flat!r} and training.{table}.{field} = {nested!r} are one setting "
        f"given twice with different values: give training.{table}.{field} only"
    )


def nest_source(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A whole config's sections (a TOML file's, a dict's) with the training section's flat
    names in their sub-tables: overrides then replace a setting whichever name either used."""
    if not isinstance(data.get("training"), dict):
        return data
    try:
        return {**data, "training": nest_flat_names(data["training"])}
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def override_path(key: str, value: Any, seen: dict[str, tuple[str, Any]]) -> str:
    """The path an override `section.field` sets: a flat name's in its sub-table
    (training.micro_batches -> training.pipeline.micro_batches), so that it replaces what the
    config holds under either name. seen: the overrides so far (path -> (key, value)); one
    setting overridden by both its names with different values is refused."""
    section, _, name = key.partition(".")
    if section != "training" or name not in FLAT_NAMES:
        path = key
    else:
        path = "training." + ".".join(FLAT_NAMES[name])
    earlier = seen.get(path)
    if earlier is not None and earlier[0] != key and earlier[1] != value:
        (flat, flat_value), nested_value = ((key, value), earlier[1]) if key != path else (earlier, value)
        raise _twice(flat.partition(".")[2], flat_value, nested_value)
    seen[path] = (key, value)
    return path


def nest_update(current: Any, update: dict[str, Any]) -> dict[str, Any]:
    """A model_copy update with each flat name routed into a copy of its sub-table."""
    update = dict(update)
    changes: dict[str, dict[str, Any]] = {}
    for name in [k for k in update if k in FLAT_NAMES]:
        table, field = FLAT_NAMES[name]
        changes.setdefault(table, {})[field] = update.pop(name)
    for table, fields in changes.items():
        update[table] = update.get(table, getattr(current, table)).model_copy(update=fields)
    return update


def merge_settings(data: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Dumped training settings (model_dump: every sub-table in full) with `changes` written
    over them, a flat name into its sub-table: a flat change must not meet its own default
    as a conflict."""
    out = dict(data)
    for name, value in changes.items():
        if name in FLAT_NAMES:
            table, field = FLAT_NAMES[name]
            out[table] = {**out.get(table, {}), field: value}
        else:
            out[name] = value
    return out


def setting_field(name: str):
    """The pydantic FieldInfo of a training setting by its flat name (or a general field's name)."""
    from .config import TrainingConfig

    if name in FLAT_NAMES:
        table, field = FLAT_NAMES[name]
        return TABLES[table].model_fields[field]
    return TrainingConfig.model_fields[name]
