"""Each parallel strategy's own settings, and the device mesh: sub-tables of `[training]`.

`[training.mesh] tp = 2` and `[training.pipeline] micro_batches = 8` are each setting's one
name: in TOML, `--set`, the API's overrides, sweeps, checkpoints' fingerprints and MLflow's
params. The names of earlier versions (`training.tp`, `training.micro_batches`,
`training.tensor.tp`, `training.dp`, ...) are read by the config reader alone
(`shardline.config`), each with one line saying its new name (`RENAMED`, `renamed`); a
registered model's stored settings and an old checkpoint's fingerprint are read through the
same table, silently (they are no user's typing).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from shardline.foundation.errors import ConfigError
from shardline.foundation.section import Section

# Imported inside the functions that use them: training.config (a cycle: it imports this module).


class MeshSettings(Section):
    """The device mesh: dp_replicate x dp_shard x tp x pp ranks, whose product is
    training.world_size. One torch DeviceMesh per job, ranks laid out pp outermost and tp
    innermost (a model's tensor-parallel ranks are neighbours: on one host). The strategy
    name is a shorthand: the dimension it names (ddp: dp_replicate, fsdp: dp_shard, tensor:
    tp, pipeline: pp) takes what the others leave of world_size (given too: dp_replicate
    does); any other dimension left unset is 1."""

    dp_replicate: int | None = Field(
        None, ge=1, description="Model replicas that each read their own part of every batch and "
        "average their gradients (DDP alone; with other dimensions FSDP2's replication, HSDP with "
        "dp_shard). Unset: 1, or what world_size leaves under strategy ddp.",
    )
    dp_shard: int | None = Field(
        None, ge=1, description="Ranks each parameter, its gradient and optimizer state are "
        "sharded over (FSDP2), each reading its own part of every batch. Unset: 1, or what "
        "world_size leaves under strategy fsdp.",
    )
    tp: int | None = Field(
        None, ge=1, description="Ranks each planned layer is split over (tensor parallel, the "
        "model's tp_plan()); they read the same batch. Unset: 1, or what world_size leaves under "
        "strategy tensor.",
    )
    pp: int | None = Field(
        None, ge=1, description="Pipeline stages: the model's pipeline_layers() cut over pp ranks "
        "([training.pipeline] says how). Unset: 1, or what world_size leaves under strategy pipeline.",
    )


class DdpSettings(Section):
    """Plain data parallel (the mesh's dp_replicate alone): every rank holds the whole
    model; gradients are all-reduced by DDP."""

    grad_compression: Literal["none", "fp16"] = Field(
        "none", description="fp16: DDP all-reduces gradients in fp16 (half the bytes). Only where "
        "the mesh is dp_replicate alone (DDP's communication hook).",
    )


class TensorSettings(Section):
    """Tensor parallel (the mesh's tp): planned Linear layers split over tp ranks (DTensor)."""

    plan: dict[str, Literal["colwise", "rowwise"]] | None = Field(
        None, description="Module path -> colwise (output features split) or rowwise (input "
        "features split, outputs summed), each colwise run closed by a rowwise layer; unset: "
        "the model's own plan (its tp_plan(), training.models.plans).",
    )


class PipelineSettings(Section):
    """Pipeline parallel (the mesh's pp): the model's layers cut into stages over pp ranks,
    run by a torch.distributed.pipelining schedule."""

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
    """strategy ps: parameter servers (no mesh: servers own whole parameters)."""

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


# training.<sub-table> -> its model.
TABLES: dict[str, type[Section]] = {
    "mesh": MeshSettings, "ddp": DdpSettings, "tensor": TensorSettings, "pipeline": PipelineSettings,
    "ps": PsSettings,
}

# Each earlier name (its path under `training`) -> the setting's name now. `dp` was the
# replicas of every 2-D strategy (fsdp's HSDP replicas, the pipelines and tensor-parallel
# groups that average their gradients): the mesh's dp_replicate.
RENAMED: dict[str, str] = {
    "dp": "mesh.dp_replicate",
    "dp_shard": "mesh.dp_shard", "fsdp.dp_shard": "mesh.dp_shard",
    "tp": "mesh.tp", "tensor.tp": "mesh.tp",
    "pp": "mesh.pp", "pipeline.pp": "mesh.pp",
    "grad_compression": "ddp.grad_compression",
    "tp_plan": "tensor.plan",
    "pipeline_schedule": "pipeline.schedule",
    "pipeline_stages_per_rank": "pipeline.stages_per_rank",
    "micro_batches": "pipeline.micro_batches",
    "pipeline_boundaries": "pipeline.boundaries",
    "pipeline_timing": "pipeline.timing",
    "ps_servers": "ps.servers",
    "ps_mode": "ps.mode",
    "ps_staleness": "ps.staleness",
}
# Tables of earlier versions that no longer exist once their settings moved out (fsdp's
# only setting was dp_shard): dropped when left empty.
_GONE_TABLES = ("fsdp",)


def renamed(training: Any) -> tuple[Any, list[str]]:
    """Raw training settings with every earlier name moved to its name now, and one line
    per earlier name met, saying the new one. An earlier name and its new one given with
    different values is refused in one line naming both."""
    if not isinstance(training, dict):
        return training, []
    data, lines = _copy_tables(training), []
    for old, new in RENAMED.items():
        table, _, field = old.rpartition(".")
        holder = data.get(table) if table else data
        if not isinstance(holder, dict) or field not in holder:
            continue
        value = holder.pop(field)
        new_table, _, new_field = new.partition(".")
        target = data.setdefault(new_table, {})
        if not isinstance(target, dict):  # not a table: pydantic names it
            continue
        if new_field in target and target[new_field] != value:
            raise ConfigError(
                f"training.{old} = {value!r} and training.{new} = {target[new_field]!r} are one setting "
                f"given twice with different values: give training.{new} only"
            )
        target[new_field] = value
        lines.append(f"training.{old} is now training.{new}: read as that (rename it in your config)")
    for table in _GONE_TABLES:
        if data.get(table) == {}:
            del data[table]
    return data, lines


def renamed_path(path: str) -> str:
    """A setting's path under `training` (an override's, a sweep's, a fingerprint's key),
    its earlier name replaced by its name now."""
    return RENAMED.get(path, path)


def _copy_tables(training: dict) -> dict:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in training.items()}
