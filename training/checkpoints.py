"""Checkpoints that resume exactly: model, optimizer, position, RNG states.

Plain tensors, numbers and strings only, so `torch.load(weights_only=True)`
reads them: loading a checkpoint never unpickles arbitrary objects. Written by
rank 0 through `pipelines.storage`, so `checkpoint_dir` may be any URL:

    checkpoint_dir/
      ckpt-000000120-3f9a1c.pt   a new object per checkpoint (step, then a fresh suffix)
      LATEST                     the pointer: written after the object it names
      ranks/rank-N.json          which host and process is rank N

A checkpoint is visible once the pointer names it: an interrupted write leaves at
most an object nothing points to. Rotation keeps the newest `keep` and never
deletes what the pointer names. `latest()` follows the pointer (a directory with no
pointer, such as one written by an earlier shardline or copied by hand, falls back
to the newest object by step).
"""

from __future__ import annotations

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
    storage.write_bytes(storage.join(directory, POINTER), json.dumps({"name": name, "step": global_step}).encode())
    for old in checkpoint_paths(directory)[:-keep]:
        if old != url:
            storage.delete(old)
    return url


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
