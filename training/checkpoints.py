"""Checkpoints that resume exactly: model, optimizer, position, RNG states.

Plain tensors, numbers and strings only, so `torch.load(weights_only=True)`
reads them: loading a checkpoint never unpickles arbitrary objects. Written by
rank 0 through `pipelines.storage`, so `checkpoint_dir` may be any URL:

    checkpoint_dir/
      ckpt-000000120-3f9a1c.pt   a new object per checkpoint (step, then a fresh suffix)
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
to the newest object by step).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import uuid

import torch

from pipelines import storage
from pipelines.errors import DataError

from .config import TrainingConfig

_NAME = re.compile(r"^ckpt-(\d{9})(-[0-9a-f]{6})?\.pt$")
POINTER = "LATEST"

# Settings a checkpoint must agree with to be resumed from: they shape the
# weights, the optimizer state or the order of batches.
FINGERPRINT_FIELDS = (
    "model", "hidden", "heads", "embedding_dim", "strategy", "world_size", "batch_size", "seed", "epochs",
    "shuffle_buffer_rows", "remainder", "dp", "tp", "pp", "dp_shard", "tp_plan", "ps_servers", "ps_mode",
    "micro_batches", "pipeline_boundaries", "pipeline_schedule", "pipeline_stages_per_rank",
)


def fingerprint(cfg: TrainingConfig, dataset_version: str) -> dict[str, str]:
    fp = {f: str(getattr(cfg, f)) for f in FINGERPRINT_FIELDS}
    fp["dataset_version"] = dataset_version
    return fp


DEFAULT_ROOT = "shardline-data/checkpoints"


def job_dir(cfg: TrainingConfig, experiment: str, registered_model: str, dataset_dir: str,
            root: str = DEFAULT_ROOT) -> str:
    """The default checkpoint_dir of a job (see the module's docstring)."""
    ident = {f: str(getattr(cfg, f)) for f in FINGERPRINT_FIELDS}
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
    return storage.join(directory, pointed)


def save(directory: str, global_step: int, state: dict, keep: int) -> str:
    """Write a new checkpoint object, then point LATEST at it, then rotate; its URL."""
    directory = str(directory)
    buf = io.BytesIO()
    torch.save(state, buf)
    name = f"ckpt-{global_step:09d}-{uuid.uuid4().hex[:6]}.pt"
    url = storage.join(directory, name)
    storage.write_bytes(url, buf.getbuffer())
    # The pointer is the commit: one whole-object write (a rename locally) after the object.
    # The fingerprint in the pointer says whose directory this is without reading a checkpoint.
    pointer = {"name": name, "step": global_step, "fingerprint": state.get("fingerprint", {})}
    storage.write_bytes(storage.join(directory, POINTER), json.dumps(pointer).encode())
    for old in checkpoint_paths(directory)[:-keep]:
        if old != url:
            storage.delete(old)
    return url


def start_over(directory: str, fp: dict[str, str]) -> None:
    """A new job's directory: drop its own earlier checkpoints (its restarts would resume
    them); refuse a directory holding another job's, which clearing would lose."""
    check_owner(directory, fp)
    clear(directory)


def check_owner(directory: str, fp: dict[str, str]) -> None:
    """Refuse `directory` to a new job when it holds another job's checkpoints."""
    theirs = owner(directory)
    if theirs:  # {}: written without a fingerprint, which no job can resume
        # Another dataset version is the same job on re-prepared data: its own to clear.
        diff = [f"{k} {theirs.get(k)!r} (this job: {v!r})" for k, v in fp.items()
                if k != "dataset_version" and theirs.get(k) != v]
        if diff:
            raise DataError(
                f"training.checkpoint_dir {storage.display(str(directory))} holds another job's "
                f"checkpoints ({', '.join(diff[:3])}{', ...' if len(diff) > 3 else ''}); a new job "
                "would delete them: give this job a checkpoint_dir of its own (unset, each job gets "
                "one under shardline-data/checkpoints/<experiment>/), resume that job with --resume, "
                "or delete them yourself"
            )


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


def clear(directory: str) -> None:
    """Drop every checkpoint of `directory` (a new job starts over): pointer first."""
    storage.delete(storage.join(str(directory), POINTER))
    for old in checkpoint_paths(directory):
        storage.delete(old)


def load(url: str, expected: dict[str, str]) -> dict:
    """Read a checkpoint and refuse one written for another model, config or dataset."""
    where = storage.display(str(url))
    try:
        with storage.open_input(str(url)) as f:
            state = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"{where}: checkpoint not found") from None
    except Exception as e:
        raise DataError(f"{where}: not a readable shardline checkpoint ({type(e).__name__})") from None
    got = state.get("fingerprint", {})
    diff = [f"{k}={got.get(k)!r} (config has {v!r})" for k, v in expected.items() if got.get(k) != v]
    if diff:
        raise DataError(f"{where}: checkpoint is from a different run: " + ", ".join(diff))
    return state
