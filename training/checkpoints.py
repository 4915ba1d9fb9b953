"""Checkpoints that resume exactly: model, optimizer, position, RNG states.

Each checkpoint is a small object and a directory beside it. Every rank writes
its weights and optimizer state into the directory itself, with
torch.distributed.checkpoint (training.sharded_checkpoints); the small object
holds the rest — position, each rank's schedule and RNG, the fingerprint — in
plain tensors, numbers and strings only, so `torch.load(weights_only=True)`
reads it: loading a checkpoint never unpickles arbitrary objects. Both go
through `pipelines.storage`, so `checkpoint_dir` may be any URL:

    checkpoint_dir/
      ckpt-000000120-3f9a1c.pt   the small object, new per checkpoint (step, then a fresh suffix)
      ckpt-000000120-7d02ee.dcp/ its ranks' weights and optimizer state (named in the object)
      LATEST                     the pointer: written after the object it names
      ranks/rank-N.json          which host and process is rank N

The default directory (`training.checkpoint_dir` unset) is one per job:
`shardline-data/checkpoints/<experiment>/<registered model>-<hash>`, the hash of the
fingerprint settings below and the dataset directory, so two configs never share one
and `--resume` of the same config finds its own. A new job clears only its own
earlier checkpoints: a directory whose `LATEST` names another job's (other
fingerprint settings) is refused, never emptied.

A checkpoint is visible once the pointer names it: an interrupted write leaves at
most an object nothing points to. Rotation keeps the newest `keep` and never
deletes what the pointer names. `latest()` follows the pointer (a directory with no
pointer, such as one written by an earlier shardline or copied by hand, falls back
to the newest object by step). `readable()` is the one a job resumes from: the
pointed one, or, when that cannot be read (truncated, corrupted), the newest older
one that can, said in one line.

The fingerprint is every setting that shapes the weights, the optimizer state or
the order of batches; a resume whose config differs is refused naming the fields,
unless the user names them as allowed to change (`training.resume_allow_changed`,
`shardline train --resume --allow-changed lr`).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import sys
import uuid

# No `import torch` here: save() and load() import it. Every CLI command resolves its job's
# checkpoint folder (job_dir) through this module, and prepare and score never need torch
# (its import was 1.1 s of each such command here).
from shardline.pipelines import storage
from shardline.pipelines.errors import ConfigError, DataError, StorageError

from .config import TrainingConfig

_NAME = re.compile(r"^ckpt-(\d{9})(-[0-9a-f]{6})?\.pt$")
_SHARDED = re.compile(r"^ckpt-\d{9}-[0-9a-f]{6}\.dcp$")  # sharded_checkpoints.new_name's
POINTER = "LATEST"

# Settings a checkpoint must agree with to be resumed from: they shape the
# weights, the optimizer state or the order of batches.
FINGERPRINT_FIELDS = (
    "model", "model_args", "loss", "hidden", "heads", "embedding_dim", "strategy", "world_size", "batch_size", "seed", "epochs",
    "shuffle_buffer_rows", "remainder", "dp", "tp", "pp", "dp_shard", "tp_plan", "ps_servers", "ps_mode",
    "micro_batches", "pipeline_boundaries", "pipeline_schedule", "pipeline_stages_per_rank",
    # the optimisation itself: a resume with another lr or schedule would quietly keep the old one
    "lr", "weight_decay", "lr_schedule", "warmup_steps", "precision", "grad_compression",
)
# Fields a resume may change when the user allows it (the rest decide the checkpoint's
# layout or the order of batches, so a checkpoint cannot carry over to other values).
CHANGEABLE_FIELDS = ("lr", "weight_decay", "lr_schedule", "warmup_steps", "epochs", "dataset_version")


# The settings that shape only the mesh (how many ranks, and how the model is laid out on
# them): a resume may change them, since every checkpoint reshards (training.sharded_checkpoints).
MESH_FIELDS = ("world_size", "dp", "tp", "pp", "dp_shard", "ps_servers", "tp_plan", "pipeline_boundaries",
               "pipeline_stages_per_rank")


class CheckpointUnreadable(DataError):
    """A checkpoint object that cannot be read back (missing, truncated, corrupted)."""


def check_allowed(allowed: list[str] | tuple[str, ...], setting: str = "training.resume_allow_changed") -> None:
    unknown = [a for a in allowed if a not in CHANGEABLE_FIELDS]
    if unknown:
        raise ConfigError(
            f"{setting}: {', '.join(unknown)} cannot change on resume; fields that can: "
            + ", ".join(CHANGEABLE_FIELDS)
        )


def fingerprint(cfg: TrainingConfig, dataset_version: str) -> dict[str, str]:
    fp = {f: str(getattr(cfg, f)) for f in FINGERPRINT_FIELDS}
    fp["dataset_version"] = dataset_version
    return fp


DEFAULT_ROOT = "shardline-data/checkpoints"


def job_dir(cfg: TrainingConfig, experiment: str, registered_model: str, dataset_dir: str,
            root: str = DEFAULT_ROOT) -> str:
    """The default checkpoint_dir of a job (see the module's docstring)."""
    # Not what a resume may change (--allow-changed lr, another mesh that reshards): the
    # resumed job must find the folder its first run wrote.
    kept = [f for f in FINGERPRINT_FIELDS if f not in CHANGEABLE_FIELDS and f not in MESH_FIELDS]
    ident = {f: str(getattr(cfg, f)) for f in kept}
    ident.update(dataset_dir=str(dataset_dir), registered_model=registered_model)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:10]
    return storage.join(root, _safe(experiment), f"{_safe(registered_model)}-{digest}")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "default"


def checkpoint_paths(directory: str) -> list[str]:
    """Checkpoint URLs in `directory`, oldest first: by step, then by time written (a step can
    have two: mid-epoch and the epoch's end, or one from before a restart)."""
    found = [
        (int(m.group(1)), i.mtime_ns or 0, i.base_name)
        for i in storage.list_dir_info(str(directory)) if (m := _NAME.match(i.base_name))
    ]
    return [storage.join(str(directory), n) for *_, n in sorted(found)]


def latest(directory: str) -> str | None:
    """The checkpoint the pointer names, else the newest by step, else None."""
    directory = str(directory)
    try:
        pointed = json.loads(storage.read_bytes(storage.join(directory, POINTER)))["name"]
    except FileNotFoundError:
        paths = checkpoint_paths(directory)
        return paths[-1] if paths else None
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{storage.display(storage.join(directory, POINTER))}: not a checkpoint pointer") from None
    # The name is joined to the directory and loaded (torch.load): anyone who can write the
    # store could point it elsewhere (../, an absolute path). Only our own names are followed.
    if not isinstance(pointed, str) or not _NAME.fullmatch(pointed):
        raise DataError(
            f"{storage.display(storage.join(directory, POINTER))}: corrupt checkpoint pointer (name "
            f"{pointed!r} is not a ckpt-<step>.pt in its folder); not followed: remove it to resume "
            "from the newest checkpoint there"
        )
    return storage.join(directory, pointed)


def save(directory: str, global_step: int, state: dict, keep: int) -> str:
    """Write a new checkpoint object, then point LATEST at it, then rotate; its URL."""
    import torch

    directory = str(directory)
    buf = io.BytesIO()
    # The small file: position, schedules, RNG, fingerprint, the DCP directory's name. No
    # weights: every rank wrote its own into that directory (training.sharded_checkpoints).
    torch.save(state, buf)
    name = f"ckpt-{global_step:09d}-{uuid.uuid4().hex[:6]}.pt"
    url = storage.join(directory, name)
    try:
        storage.write_bytes(url, buf.getbuffer())
        # The pointer is the commit: one whole-object write (a rename locally) after the object.
        # The fingerprint in the pointer says whose directory this is without reading a checkpoint.
        pointer = {"name": name, "step": global_step, "epoch": state.get("epoch"),
                   "fingerprint": state.get("fingerprint", {})}
        storage.write_bytes(storage.join(directory, POINTER), json.dumps(pointer).encode())
    except OSError as e:  # a full disk, a read-only mount, no permission: no restart fixes it
        raise StorageError(f"training.checkpoint_dir: cannot write {storage.display(url)} ({_cause(e)})") from None
    for old in checkpoint_paths(directory)[:-keep]:
        if old != url:
            storage.delete(old)
    return url


def start_over(directory: str, fp: dict[str, str], own_folder: bool = False) -> None:
    """A new job's directory: drop its own earlier checkpoints (its restarts would resume
    them); refuse a directory holding another job's, which clearing would lose."""
    replaced = check_owner(directory, fp, own_folder)
    if replaced:
        print(f"[shardline] starting over in this job's own checkpoint folder "
              f"{storage.display(str(directory))}: the checkpoints of its earlier run ({', '.join(replaced)}) "
              f"are replaced (--resume --allow-changed would have continued them)", file=sys.stderr, flush=True)
    clear(directory)


# What a job's own folder (job_dir) leaves out of its name: runs that differ only here share it.
_NOT_IN_FOLDER_NAME = (*CHANGEABLE_FIELDS, *MESH_FIELDS)


def check_owner(directory: str, fp: dict[str, str], own_folder: bool = False) -> list[str]:
    """Refuse `directory` to a new job when it holds another job's checkpoints.

    own_folder: `directory` is this job's own (job_dir, checkpoint_dir unset): an earlier
    run there that differs only in what its name leaves out (epochs, lr, the mesh) is this
    job's earlier run, which a new run replaces. Returns those differences."""
    theirs = owner(directory)
    if theirs:  # {}: written without a fingerprint, which no job can resume
        # Another dataset version is the same job on re-prepared data: its own to clear.
        diff = [f"{k} {theirs.get(k)!r} (this job: {v!r})" for k, v in fp.items()
                if k != "dataset_version" and theirs.get(k) != v]
        if own_folder and all(d.split(" ", 1)[0] in _NOT_IN_FOLDER_NAME for d in diff):
            return [f"{k} {theirs.get(k)}" for k, v in fp.items()
                    if k != "dataset_version" and theirs.get(k) != v]
        if diff:
            raise DataError(
                f"training.checkpoint_dir {storage.display(str(directory))} holds another job's "
                f"checkpoints ({', '.join(diff[:3])}{', ...' if len(diff) > 3 else ''}); a new job "
                "would delete them: give this job a checkpoint_dir of its own (unset, each job gets "
                "one under shardline-data/checkpoints/<experiment>/), resume that job with --resume, "
                "or delete them yourself"
            )
    return []


def owner(directory: str) -> dict[str, str] | None:
    """The fingerprint of the job whose checkpoints `directory` holds; None when it holds none."""
    directory = str(directory)
    try:
        pointer = json.loads(storage.read_bytes(storage.join(directory, POINTER)))
    except FileNotFoundError:
        pointer = {}
    except ValueError:
        pointer = {}  # latest() below names the damage
    if isinstance(pointer, dict) and isinstance(pointer.get("fingerprint"), dict):
        return pointer["fingerprint"]
    newest = latest(directory)  # a pointer from before fingerprints were in it, or none
    return None if newest is None else load(newest, {}).get("fingerprint", {})


def check_unfinished(directory: str, epochs: int, allow_changed=(), fp: dict[str, str] | None = None) -> None:
    """Refuse a resume whose newest checkpoint already ends the job (its last epoch done):
    it would take 0 steps and register the same weights as a new version. fp: this job's
    fingerprint; a checkpoint of another run is left to `load`'s refusal, which names it."""
    directory = str(directory)
    try:
        pointer = json.loads(storage.read_bytes(storage.join(directory, POINTER)))
        pointer = pointer if isinstance(pointer, dict) else {}
    except (FileNotFoundError, ValueError):
        pointer = {}
    epoch, theirs = pointer.get("epoch"), pointer.get("fingerprint")
    if epoch is None:  # a pointer from before it held the epoch, or none: read the checkpoint
        found = readable(directory, {})
        epoch, theirs = (found[1].get("epoch"), found[1].get("fingerprint")) if found else (None, None)
    if fp and isinstance(theirs, dict) and any(
        theirs.get(k) != v for k, v in fp.items() if k not in allow_changed and k != "dataset_version"
    ):
        return
    if epoch is None or epoch < epochs:
        return
    more = ("raise training.epochs (e.g. --set training.epochs={n} --allow-changed epochs)"
            if "epochs" not in allow_changed else "raise training.epochs").format(n=epoch + 1)
    raise DataError(
        f"{storage.display(directory)}: the newest checkpoint ends the job (epoch {epoch} of "
        f"training.epochs = {epochs} done): a resume would train 0 steps; to train further, {more}; "
        f"to start over, train without --resume"
    )


def clear(directory: str) -> None:
    """Drop every checkpoint of `directory` (a new job starts over): pointer first."""
    storage.delete(storage.join(str(directory), POINTER))
    for old in checkpoint_paths(directory):
        storage.delete(old)


def load(url: str, expected: dict[str, str], allow_changed=()) -> dict:
    """Read a checkpoint and refuse one written for another model, config or dataset
    (fields in `allow_changed` may differ)."""
    import torch

    where = storage.display(str(url))
    try:
        with storage.open_input(str(url)) as f:
            state = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointUnreadable(f"{where}: checkpoint not found") from None
    except Exception as e:
        raise CheckpointUnreadable(f"{where}: not a readable shardline checkpoint ({_cause(e)})") from None
    got = state.get("fingerprint", {})
    diff = [f"{k}={got.get(k)!r} (config has {v!r})" for k, v in expected.items()
            if got.get(k) != v and k not in allow_changed]
    if diff:
        raise DataError(
            f"{where}: checkpoint is from a different run: " + ", ".join(diff)
            + _allow_hint([k for k, v in expected.items() if got.get(k) != v])
        )
    # The weights are in the DCP directory the small file names (training.sharded_checkpoints),
    # whose .metadata is written last: without it the checkpoint cannot be resumed.
    sharded = state.get("sharded")
    # Joined to the folder and read by every rank, like LATEST's name: only our own names.
    if sharded is not None and not (isinstance(sharded, str) and _SHARDED.fullmatch(sharded)):
        raise CheckpointUnreadable(f"{where}: corrupt checkpoint (DCP directory {sharded!r} is not a "
                                   "ckpt-<step>-<id>.dcp in its folder); not followed")
    if isinstance(sharded, str) and not storage.exists(storage.join(storage.parent(str(url)), sharded, ".metadata")):
        raise CheckpointUnreadable(f"{where}: its DCP directory {sharded} is missing or incomplete (no .metadata)")
    return state


_FALLBACKS_SAID: set[tuple[str, str]] = set()


def readable(directory: str, expected: dict[str, str], allow_changed=()) -> tuple[str, dict] | None:
    """The checkpoint to resume from and its state: the one the pointer names, else (it
    cannot be read) the newest older one that can, said in one line. None: no checkpoint.
    A checkpoint of another run is refused, never skipped: an older one would be too."""
    first = latest(directory)
    if first is None:
        return None
    try:
        return first, load(first, expected, allow_changed)
    except CheckpointUnreadable as e:
        bad = e
    for url in reversed([p for p in checkpoint_paths(directory) if p != first]):
        try:
            state = load(url, expected, allow_changed)
        except CheckpointUnreadable:
            continue
        # Said once per process: the driver's preflight (a finished job?) and the launch
        # both look for the checkpoint to resume from.
        if (first, url) not in _FALLBACKS_SAID:
            _FALLBACKS_SAID.add((first, url))
            print(f"[shardline] {bad}; resuming from {storage.name(url)}, the newest readable one",
                  file=sys.stderr, flush=True)
        return url, state
    raise CheckpointUnreadable(f"{bad}; no older checkpoint in {storage.display(directory)} is readable either")


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


def _allow_hint(fields: list[str]) -> str:
    changeable = [f for f in fields if f in CHANGEABLE_FIELDS]
    if not changeable or len(changeable) < len(fields):
        return ""
    return f" (to resume with the new value, allow it: --allow-changed {','.join(changeable)})"


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__
