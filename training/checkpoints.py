"""Checkpoints that resume exactly: model, optimizer, position, RNG states.

Plain tensors, numbers and strings only, so `torch.load(weights_only=True)`
reads them: loading a checkpoint never unpickles arbitrary objects. Written by
rank 0 (DDP replicas are identical) to a temporary name, then renamed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from pipelines.errors import DataError

from .config import TrainingConfig

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")

# Settings a checkpoint must agree with to be resumed from: they shape the
# weights, the optimizer state or the order of batches.
FINGERPRINT_FIELDS = (
    "model", "hidden", "embedding_dim", "strategy", "world_size", "batch_size", "seed", "epochs",
    "shuffle_buffer_rows", "remainder", "dp", "tp", "pp", "ps_servers", "ps_mode",
    "micro_batches", "pipeline_boundaries", "pipeline_schedule", "pipeline_stages_per_rank",
)


def fingerprint(cfg: TrainingConfig, dataset_version: str) -> dict[str, str]:
    fp = {f: str(getattr(cfg, f)) for f in FINGERPRINT_FIELDS}
    fp["dataset_version"] = dataset_version
    return fp


def checkpoint_paths(directory: str | Path) -> list[Path]:
    """Checkpoints in `directory`, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _NAME.match(p.name))


def latest(directory: str | Path) -> Path | None:
    paths = checkpoint_paths(directory)
    return paths[-1] if paths else None


def save(directory: str | Path, global_step: int, state: dict, keep: int) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"ckpt-{global_step:09d}.pt"
    tmp = d / f".{final.name}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for old in checkpoint_paths(d)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load(path: Path, expected: dict[str, str]) -> dict:
    """Read a checkpoint and refuse one written for another model, config or dataset."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DataError(f"{path}: not a readable shardline checkpoint ({type(e).__name__})") from None
    got = state.get("fingerprint", {})
    diff = [f"{k}={got.get(k)!r} (config has {v!r})" for k, v in expected.items() if got.get(k) != v]
    if diff:
        raise DataError(f"{path}: checkpoint is from a different run: " + ", ".join(diff))
    return state
