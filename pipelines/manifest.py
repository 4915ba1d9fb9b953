"""The data contract: a prepared dataset is the files its manifest names, nothing else.

Layout of a dataset directory:

    manifest.json          written last, by an atomic os.replace: the commit point
    v-<version-id>/<split>/shard-00000.parquet

A version directory no manifest names is an interrupted prepare; the next
prepare removes it. Readers never list directories.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .config import FeatureSpec, LayoutConfig
from .errors import DataError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
VERSION_PREFIX = "v-"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShardInfo(_Model):
    path: str = Field(description="Relative to the dataset directory.")
    rows: int
    bytes: int
    row_groups: int
    sha256: str


class SplitInfo(_Model):
    rows: int
    shards: list[ShardInfo]


class NumericStats(_Model):
    mean: float
    std: float


class FittedStatistics(_Model):
    """Fitted on the train split only; serving reuses them, so there is no skew."""

    numeric: dict[str, NumericStats]
    categorical: dict[str, list[str]] = Field(
        description="Vocabulary per column, most frequent first; index i+1, 0 is unknown "
        "(empty with the hash encoding)."
    )
    cardinality: dict[str, int] = Field(
        description="Distinct indices per categorical column, the unknown/null 0 excluded."
    )
    num_classes: int = Field(description="Classes (classification); 1 for regression.")


class TensorSpec(_Model):
    column: str
    dtype: Literal["float32", "int64"]
    shape: list[int]


class BandwidthPlan(_Model):
    """Filled by the planner (`shardline plan`, training.plan); `prepare --plan` lays
    shards out by it and training takes its loader workers. Every field is optional
    so manifests written before a field existed still load."""

    train_samples_per_s: float | None = Field(
        None, description="Measured per-rank training samples/s (compute only: an upper bound)."
    )
    loader_samples_per_s_per_worker: float | None = Field(
        None, description="Measured loader samples/s of one loader worker on the real shards."
    )
    loader_workers_per_rank: int | None = Field(None, description="Chosen loader workers per rank.")
    shards_per_rank: int | None = Field(None, description="Chosen train shards per rank.")
    rows_per_row_group: int | None = Field(None, description="Chosen Parquet row group size.")
    world_size: int | None = Field(None, description="Ranks the plan is for.")
    local_batch: int | None = Field(None, description="Per-rank batch the training was measured at.")
    headroom: float | None = Field(None, description="Target: loading >= headroom x training.")
    required_loader_workers: int | None = Field(
        None, description="Workers the target needs, before the cap of cores per rank."
    )
    max_loader_workers_per_rank: int | None = Field(None, description="The cap: cores per rank.")
    loading_samples_per_s: float | None = Field(
        None, description="Predicted per-rank loading samples/s: workers x per-worker figure."
    )
    target_met: bool | None = Field(None, description="loading_samples_per_s >= headroom x training.")
    predicted_data_wait: float | None = Field(
        None, description="Predicted share of step time waiting for data: max(0, 1 - loading/training)."
    )
    device: str | None = Field(None, description="Device the training figure was measured on.")
    model: str | None = Field(None, description="Model, strategy and precision measured.")
    measured_at: str | None = Field(None, description="UTC time of the measurement.")


class ShardManifest(_Model):
    format_version: int = FORMAT_VERSION
    version_id: str
    created_at: str
    engine: dict[str, str] = Field(description="name and version of the engine that wrote it")
    sources: list[dict[str, str | int]] = Field(
        description="Every raw input prepared into this dataset, oldest first (append adds one)."
    )
    arrow_schema: list[dict[str, str]]
    feature_spec: FeatureSpec
    tensors: dict[str, TensorSpec] = Field(
        description="Model inputs: `features` (float32: standardised numerics, vector "
        "elements, then categorical indices) and `label`."
    )
    statistics: FittedStatistics
    layout: LayoutConfig
    splits: dict[str, SplitInfo]
    plan: BandwidthPlan | None = None
    dropped_rows: int = Field(0, description="Rows dropped as unparseable (on_bad_rows = drop).")

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits or not self.splits[name].shards:
            have = ", ".join(s for s, info in self.splits.items() if info.shards) or "none"
            raise DataError(f"dataset has no '{name}' split (splits with data: {have})")
        return self.splits[name]


def manifest_path(dataset_dir: str | os.PathLike) -> Path:
    return Path(dataset_dir) / MANIFEST_NAME


def load_manifest(dataset_dir: str | os.PathLike) -> ShardManifest:
    path = manifest_path(dataset_dir)
    if not path.is_file():
        raise DataError(f"{path}: no manifest; run `shardline prepare` first")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != FORMAT_VERSION:
        raise DataError(
            f"{path}: manifest format version {version!r} is not supported "
            f"(this shardline reads version {FORMAT_VERSION})"
        )
    try:
        return ShardManifest.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise DataError(f"{path}: invalid manifest at {where}: {err['msg']}") from None


def new_version_dir(dataset_dir: str | os.PathLike) -> tuple[str, Path]:
    """Claim a fresh, not yet visible version directory inside `dataset_dir`.

    Refuses a directory that holds something other than a shardline dataset:
    we never write into, or later clean up, files we did not make.
    """
    root = Path(dataset_dir)
    if root.exists():
        if not root.is_dir():
            raise DataError(f"{root}: output path exists and is not a directory")
        foreign = [p.name for p in root.iterdir() if not _ours(p)]
        if foreign:
            raise DataError(
                f"{root}: output directory exists and is not a shardline dataset "
                f"(found {foreign[0]!r}); choose another dataset_dir or remove it"
            )
        # Leftovers of an interrupted prepare go now, before they pile up.
        previous = load_manifest(root) if manifest_path(root).exists() else None
        remove_unreferenced(root, previous)
    version_id = uuid.uuid4().hex[:12]
    path = root / f"{VERSION_PREFIX}{version_id}"
    path.mkdir(parents=True)
    return version_id, path


def commit_manifest(dataset_dir: str | os.PathLike, manifest: ShardManifest) -> Path:
    """Make `manifest` the dataset: one atomic rename, then drop unreferenced versions."""
    root = Path(dataset_dir)
    final = _write_manifest(root, manifest)
    remove_unreferenced(root, manifest)
    return final


def store_plan(dataset_dir: str | os.PathLike, version_id: str, plan: BandwidthPlan) -> ShardManifest:
    """Replace the plan of dataset version `version_id`, nothing else, atomically.

    The version check refuses to bring back a version a prepare replaced while the
    plan was being measured. No cleanup of unreferenced versions: a prepare running
    now owns its not yet committed version directory.
    """
    root = Path(dataset_dir)
    current = load_manifest(root)
    if current.version_id != version_id:
        raise DataError(
            f"{root}: the dataset changed while planning (version {version_id} is now "
            f"{current.version_id}); run `shardline plan` again"
        )
    updated = current.model_copy(update={"plan": plan})
    _write_manifest(root, updated)
    return updated


def _write_manifest(root: Path, manifest: ShardManifest) -> Path:
    """Temp file, fsync, rename over manifest.json, fsync the directory: all or nothing."""
    final = root / MANIFEST_NAME
    tmp = root / f".{MANIFEST_NAME}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(manifest.model_dump_json(indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(root)
    return final


def remove_unreferenced(root: Path, manifest: ShardManifest | None) -> None:
    keep = set()
    if manifest is not None:
        for info in manifest.splits.values():
            keep.update(Path(s.path).parts[0] for s in info.shards)
        keep.add(f"{VERSION_PREFIX}{manifest.version_id}")
    for p in root.iterdir():
        if p.name.startswith(VERSION_PREFIX) and p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(f".{MANIFEST_NAME}.") and p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)


def _ours(p: Path) -> bool:
    return (
        p.name == MANIFEST_NAME
        or p.name.startswith(VERSION_PREFIX)
        or (p.name.startswith(f".{MANIFEST_NAME}.") and p.name.endswith(".tmp"))
    )


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
