"""Whose checkpoints these are: the fingerprint, and the folder a job's checkpoints go to.

The folder itself (its small files, DCP directories, `LATEST`, fallback, hold) is owned
by `training.checkpoints.store.CheckpointStore`; this module says what a checkpoint must
agree with to be resumed, and names a job's own folder.

The fingerprint is every setting that shapes the weights, the optimizer state or the
order of batches (a user's loop: its import path and `training.loop_args` too), the dataset version, and the digest of the user's code (`code`: the
files that ship to the ranks, `foundation.code_travel.snapshot`; "" for a built-in model).
A resume whose config or code differs is refused naming the fields (for the code: the
files), unless the user names them as allowed to change (`training.resume_allow_changed`,
`shardline train --resume --allow-changed lr,code`). A checkpoint written before the
code was in the fingerprint has no `code`: its code cannot be compared, and is not.

The default folder (`training.checkpoint_dir` unset) is one per job:
`shardline-data/checkpoints/<experiment>/<registered model>-<hash>`, the hash of the
fingerprint settings that a resume cannot change and of the dataset directory (not the
dataset version, not the code: a resume after an edit finds its folder), so two configs
never share one and `--resume` of the same config finds its own.
"""

from __future__ import annotations

import hashlib
import json
import re

# No `import torch` here: every CLI command resolves its job's checkpoint folder (job_dir)
# through this module, and prepare and score never need torch (1.1 s of each command).
from shardline.foundation import storage
from shardline.foundation.code_travel import UserCode
from shardline.foundation.errors import ConfigError, DataError

from ..config import TrainingConfig
from ..mesh_shape import mesh_of
from ..strategy_settings import RENAMED

# Settings a checkpoint must agree with to be resumed from, by their names under `training`:
# they shape the weights, the optimizer state or the order of batches. The mesh's are its
# resolved degrees (`mesh_of`): the same mesh however the config spelled it.
FINGERPRINT_FIELDS = (
    "model", "model_args", "loss", "hidden", "heads", "embedding_dim", "strategy", "world_size", "batch_size", "seed", "epochs",
    "shuffle_buffer_rows", "remainder", "mesh.dp_replicate", "mesh.dp_shard", "mesh.tp", "mesh.pp", "tensor.plan",
    "ps.servers", "ps.mode", "pipeline.micro_batches", "pipeline.boundaries", "pipeline.schedule",
    "pipeline.stages_per_rank",
    # the optimisation itself: a resume with another lr or schedule would quietly keep the old one
    "lr", "weight_decay", "lr_schedule", "warmup_steps", "precision", "ddp.grad_compression",
)
# Fields a resume may change when the user allows it (the rest decide the checkpoint's
# layout or the order of batches, so a checkpoint cannot carry over to other values).
CHANGEABLE_FIELDS = ("lr", "weight_decay", "lr_schedule", "warmup_steps", "epochs", "dataset_version", "code")

# The settings that shape only the mesh (how many ranks, and how the model is laid out on
# them): a resume may change them, since every checkpoint reshards (training.checkpoints.sharded).
LAYOUT_FIELDS = ("world_size", "mesh.dp_replicate", "mesh.dp_shard", "mesh.tp", "mesh.pp", "ps.servers", "tensor.plan",
                 "pipeline.boundaries", "pipeline.stages_per_rank")
# The strategy too: its name is a shorthand for a mesh (ps's servers hold plain names as well).
# It stays in the folder's name (below), as before the mesh.
MESH_FIELDS = ("strategy", *LAYOUT_FIELDS)

# What a job's own folder (job_dir) leaves out of its name: runs that differ only here share it.
NOT_IN_FOLDER_NAME = (*CHANGEABLE_FIELDS, *LAYOUT_FIELDS)

# Fields that never make a checkpoint "another job's": the same job on re-prepared data or
# on edited code (a new run there starts over; a resume compares them itself).
SAME_JOB_FIELDS = ("dataset_version", "code")

DEFAULT_ROOT = "shardline-data/checkpoints"


class CheckpointUnreadable(DataError):
    """A checkpoint object that cannot be read back (missing, truncated, corrupted)."""


class ResumeRefused(DataError):
    """A resume the checkpoint folder refuses: nothing to resume, a checkpoint of another run
    (a setting changed), a job already finished. Exit code 2, as a changed code's refusal
    (a ConfigError) and a mesh that cannot reshard: the command as given is what to change
    (--allow-changed, training.epochs, or no --resume)."""

    exit_code = 2


def check_allowed(allowed: list[str] | tuple[str, ...], setting: str = "training.resume_allow_changed") -> None:
    unknown = [a for a in allowed if a not in CHANGEABLE_FIELDS]
    if unknown:
        raise ConfigError(
            f"{setting}: {', '.join(unknown)} cannot change on resume; fields that can: "
            + ", ".join(CHANGEABLE_FIELDS)
        )


def settings(cfg: TrainingConfig, names) -> dict[str, str]:
    """Each named setting's value as a fingerprint holds it; the mesh's as resolved."""
    mesh = mesh_of(cfg)
    degrees = {f"mesh.{k}": v for k, v in (mesh.as_settings() if mesh else {}).items()}
    return {f: str(degrees[f] if f in degrees else cfg.setting(f)) for f in names}


def fingerprint(cfg: TrainingConfig, dataset_version: str, code: UserCode | None = None) -> dict[str, str]:
    """The job's fingerprint; `code`: the user's code as it ships (None leaves `code` out:
    only for reading, a job's own fingerprint always has it)."""
    fp = settings(cfg, FINGERPRINT_FIELDS)
    fp.update(loop_fields(cfg))
    fp["dataset_version"] = dataset_version
    if code is not None:
        fp["code"] = code.digest
    return fp


def loop_fields(cfg: TrainingConfig) -> dict[str, str]:
    """A user's loop's import path and settings: they shape everything it trains. Only for a
    job with one: shardline's own loop leaves the fingerprint (and its folder) as they were."""
    return {"loop": str(cfg.loop), "loop_args": str(cfg.loop_args)} if cfg.loop else {}


def upgraded(fp: dict) -> dict:
    """A checkpoint's fingerprint under today's setting names: one written before the mesh
    and the strategy sub-tables holds the earlier flat names (`dp`, `micro_batches`, ...)."""
    return {RENAMED.get(k, k): v for k, v in fp.items()}


def differences(theirs: dict, ours: dict[str, str], ignore=()) -> list[str]:
    """The keys of `ours` whose value `theirs` (a checkpoint's fingerprint) does not have,
    but for `ignore`, and for `code` when `theirs` has none (written before the code was
    fingerprinted: it cannot be compared)."""
    theirs = upgraded(theirs)
    return [k for k, v in ours.items()
            if k not in ignore and not (k == "code" and "code" not in theirs) and theirs.get(k) != v]


def comparable(fp: dict[str, str] | None) -> dict[str, str]:
    """The fingerprint a checkpoint must match to be from the same run: all but the mesh,
    which checkpoints.sharded.check_resume judges on the driver (it may change where the
    checkpoint reshards)."""
    return {k: v for k, v in (fp or {}).items() if k not in MESH_FIELDS}


def job_dir(cfg: TrainingConfig, experiment: str, registered_model: str, dataset_dir: str,
            root: str = DEFAULT_ROOT) -> str:
    """The default checkpoint_dir of a job (see the module's docstring)."""
    # Not what a resume may change (--allow-changed lr, another mesh that reshards): the
    # resumed job must find the folder its first run wrote.
    # The strategy's name stays in it, as before the mesh: a job's folder is the one it had (a
    # resume at another strategy name, which reshards, names its checkpoint_dir).
    kept = [f for f in FINGERPRINT_FIELDS if f not in NOT_IN_FOLDER_NAME]
    # Hashed under the settings' earlier flat names: a job's folder is the one it had before
    # they moved into sub-tables, so --resume across the upgrade finds its checkpoints.
    flat = {new: old for old, new in RENAMED.items() if "." not in old}
    ident = {flat.get(f, f): v for f, v in settings(cfg, kept).items()}
    ident.update(loop_fields(cfg))
    ident.update(dataset_dir=str(dataset_dir), registered_model=registered_model)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:10]
    return storage.join(root, _safe(experiment), f"{_safe(registered_model)}-{digest}")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "default"


def apply_changed(optimizer, scheduler, cfg: TrainingConfig, allow_changed=()) -> None:
    """After loading a checkpoint's optimizer and schedule, put the allowed changes in:
    both state dicts carry the old lr and weight decay, which would otherwise win."""
    if optimizer is None or not {"lr", "weight_decay"} & set(allow_changed):
        return
    for group in optimizer.param_groups:
        if "lr" in allow_changed:
            group["initial_lr"] = cfg.lr
        if "weight_decay" in allow_changed:
            group["weight_decay"] = cfg.weight_decay
    if scheduler is not None and "lr" in allow_changed:
        scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
        for group, factor in zip(optimizer.param_groups, [f(scheduler.last_epoch) for f in scheduler.lr_lambdas]):
            group["lr"] = cfg.lr * factor


def allow_hint(fields: list[str]) -> str:
    changeable = [f for f in fields if f in CHANGEABLE_FIELDS]
    if not changeable or len(changeable) < len(fields):
        return ""
    return f" (to resume with the new value, allow it: --allow-changed {','.join(changeable)})"


def code_refusal(where: str, changes: list[str]) -> ConfigError:
    """The one line refusing a resume over changed code, naming the files (`changes`:
    CheckpointStore.code_changes; the first six, then how many more)."""
    named = ", ".join(changes[:6]) + (f" and {len(changes) - 6} more" if len(changes) > 6 else "")
    return ConfigError(f"{where}: the code changed since the checkpoint: {named}; to resume with it: --allow-changed code")
