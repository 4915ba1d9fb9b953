"""The data contract: a prepared dataset is the files its newest manifest names, nothing else.

Layout of a dataset (a local directory or an object store prefix: a URL):

    _manifests/manifest-000000007.json   one per committed version, each written by ONE
                                         create-only write after every shard it names
    v-<version-id>/<split>/shard-00000.parquet
    _lease.json                          held by the prepare writing here (foundation.lease)
    manifest.json                        a dataset of an earlier shardline (read as version 0)

Readers take the newest manifest, or the one they pinned: a job's ranks read the
version its driver checked, whatever was committed since. Earlier versions stay
for `pipelines.retention`, so a job started on one finishes on it. A version
directory no manifest names is an interrupted prepare; the next prepare removes
it. Readers never list version directories: a file no manifest names does not exist.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from shardline.foundation import commit, storage
from .config import FeatureSpec, LayoutConfig, RetentionConfig
from shardline.foundation.errors import DataError
from shardline.foundation.lease import LEASE_NAME

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"  # the single manifest of datasets written before _manifests/
MANIFESTS = "_manifests"
VERSION_PREFIX = "v-"
# `shardline plan --hosts` writes its forecast here; the next training run logs it to MLflow
# (training.tracking.log_forecast) beside what the run measured.
FORECAST_NAME = "_forecast.json"
_NUMBERED = re.compile(r"^manifest-(\d{9})\.json$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _inside(path: str, what: str) -> str:
    # A reader joins this to the dataset's URL: it must not reach outside it.
    parts = path.split("/")
    if (
        not path or path.startswith("/") or "\\" in path or "://" in path or ":" in parts[0]
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ValueError(f"{what} path {path!r} is not a relative path inside the dataset")
    return path


class ShardInfo(_Model):
    path: str = Field(description="Relative to the dataset directory, and inside it.")
    rows: int
    bytes: int
    row_groups: int
    sha256: str

    @field_validator("path")
    @classmethod
    def _inside_the_dataset(cls, path: str) -> str:
        return _inside(path, "shard")


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
    label: NumericStats | None = Field(
        None,
        description="Regression: mean and std of the train split's label. Training with the "
        "default loss standardises the label with them, and the model it registers gives "
        "values in the label's units (None: a classification dataset, or one prepared before).",
    )


class RejectsInfo(_Model):
    """The rows a prepare dropped, by key and reason (pipelines.rejects)."""

    path: str = Field(description="The rejects Parquet file, relative to the dataset directory.")
    rows: int = Field(description="Rows the file holds: the first `cap` dropped, in file and row order.")
    total: int = Field(description="Rows dropped in all (the manifest's dropped_rows).")
    cap: int = Field(description="The most rows the file holds.")

    @field_validator("path")
    @classmethod
    def _inside_the_dataset(cls, path: str) -> str:
        return _inside(path, "rejects")


class TensorSpec(_Model):
    """One model input (or the label): the shard column holding it and what it decodes to."""

    column: str
    dtype: Literal["uint8", "int32", "int64", "float16", "bfloat16", "float32"] = Field(
        description="Element type of the decoded tensor (the loader's torch dtype)."
    )
    shape: list[int] = Field(description="Shape of one row's tensor ([] for a scalar).")
    encoding: Literal["plain", "raw", "image"] = Field(
        "plain",
        description="plain: Arrow values of `dtype` (a list for `features`, a scalar label); "
        "raw: fixed_size_binary, each row's elements in C order, little-endian (bfloat16 as "
        "the top 16 bits of its float32); image: PNG or JPEG bytes, decoded to uint8 "
        "[C, H, W] (resized when feature_spec.images[column].resize).",
    )


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
        description="Model inputs by name: `features` (float32: standardised numerics, vector "
        "elements, then categorical indices; absent when a spec of tensor/image columns has "
        "no tabular column), every tensor and image column under its own name, and `label`."
    )
    statistics: FittedStatistics
    layout: LayoutConfig
    splits: dict[str, SplitInfo]
    plan: BandwidthPlan | None = None
    dropped_rows: int = Field(0, description="Rows dropped as unparseable (on_bad_rows = drop).")
    imputed_values: dict[str, int] = Field(
        default_factory=dict,
        description="Feature values filled in, per column, in all splits (on_invalid_features = "
        "impute: NaN, inf or null, as the train mean); columns with none are left out.",
    )
    rejects: RejectsInfo | None = Field(
        None, description="Where the dropped rows' keys and reasons are (None: no row was dropped)."
    )
    # Its commit number, from the file name (_manifests/manifest-<sequence>.json); 0 for a
    # manifest.json. Not written into the file: the name is the commit.
    _sequence: int = PrivateAttr(0)

    @property
    def sequence(self) -> int:
        return self._sequence

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits or not self.splits[name].shards:
            have = ", ".join(s for s, info in self.splits.items() if info.shards) or "none"
            raise DataError(f"dataset has no '{name}' split (splits with data: {have})")
        return self.splits[name]



# -- reading: the newest version, or a pinned one ---------------------------------------


def manifest_url(dataset_dir: str, sequence: int) -> str:
    if sequence == 0:
        return storage.join(dataset_dir, MANIFEST_NAME)
    return storage.join(dataset_dir, MANIFESTS, f"manifest-{sequence:09d}.json")


def sequences(dataset_dir: str) -> list[int]:
    """Committed versions of the dataset, oldest first (0: a manifest.json of old)."""
    found = [int(m.group(1)) for n in storage.list_dir(storage.join(dataset_dir, MANIFESTS)) if (m := _NUMBERED.match(n))]
    if storage.is_file(storage.join(dataset_dir, MANIFEST_NAME)):
        found.append(0)
    return sorted(found)


def has_manifest(dataset_dir: str) -> bool:
    return bool(sequences(dataset_dir))


def load_manifest(dataset_dir: str, sequence: int | None = None) -> ShardManifest:
    """The newest committed version, or version `sequence` (what a job pinned)."""
    dataset_dir = str(dataset_dir)
    if sequence is None:
        found = sequences(dataset_dir)
        if not found:
            where = storage.display(storage.join(dataset_dir, MANIFEST_NAME))
            raise DataError(f"{where}: no manifest; run `shardline prepare` first")
        sequence = found[-1]
    url = manifest_url(dataset_dir, sequence)
    try:
        data = storage.read_bytes(url)
    except FileNotFoundError:
        raise DataError(
            f"{storage.display(url)}: dataset version {sequence} is gone (older than "
            f"pipelines.retention keeps); run the job again on the current version"
        ) from None
    return parse_manifest(data, storage.display(url), sequence)


def parse_manifest(data: bytes, where: str, sequence: int) -> ShardManifest:
    try:
        raw = json.loads(data)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != FORMAT_VERSION:
        raise DataError(
            f"{where}: manifest format version {version!r} is not supported "
            f"(this shardline reads version {FORMAT_VERSION})"
        )
    try:
        manifest = ShardManifest.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        at = ".".join(str(p) for p in err["loc"])
        raise DataError(f"{where}: invalid manifest at {at}: {err['msg'].removeprefix('Value error, ')}") from None
    manifest._sequence = sequence
    return manifest


# -- writing: one create-only write per version ------------------------------------------


def new_version_dir(dataset_dir: str) -> tuple[str, str]:
    """Claim a fresh, not yet visible version directory (its URL) inside `dataset_dir`.

    Call it holding the dataset's lease. Leftovers of an interrupted prepare go now,
    before they pile up.
    """
    check_dataset_dir(dataset_dir)
    remove_unreferenced(dataset_dir)
    version_id = uuid.uuid4().hex[:12]
    return version_id, storage.join(dataset_dir, f"{VERSION_PREFIX}{version_id}")


def check_dataset_dir(dataset_dir: str) -> None:
    """Refuse a path that holds something other than a shardline dataset: we never write
    into, or later clean up, files we did not make. Reads only."""
    storage.check_ours(
        dataset_dir, _ours,
        "output directory exists and is not a shardline dataset (found {found}); "
        "choose another dataset_dir or remove it",
    )


def commit_manifest(
    dataset_dir: str, manifest: ShardManifest, based_on: ShardManifest | None,
    retention: RetentionConfig | None = None,
) -> ShardManifest:
    """Make `manifest` the dataset's newest version: one create-only write of the next number.

    based_on: the version this one was made from (None: the dataset had none). A
    plan stored on it since is not a conflict; another version committed since is
    (only a job that lost the dataset's lease could have made it). Then removes
    what `retention` no longer keeps.
    """
    data = manifest.model_dump_json(indent=2).encode()
    for _ in range(5):
        found = sequences(dataset_dir)
        newest = found[-1] if found else 0
        if found and (based_on is None or newest != based_on.sequence):
            current = load_manifest(dataset_dir, newest)
            if based_on is None or current.version_id != based_on.version_id:
                raise DataError(
                    f"{storage.display(dataset_dir)}: another prepare committed version "
                    f"{current.version_id} meanwhile; nothing was committed, run prepare again"
                )
        if commit.create_only(manifest_url(dataset_dir, newest + 1), data) is not None:
            committed = manifest.model_copy()
            committed._sequence = newest + 1
            if retention is not None:
                prune(dataset_dir, retention)
            return committed
    raise DataError(f"{storage.display(dataset_dir)}: the manifest commit kept being contended")


def store_plan(dataset_dir: str, version_id: str, plan: BandwidthPlan) -> ShardManifest:
    """Commit version `version_id` again with `plan`, nothing else changed.

    The version check refuses to bring back a version a prepare replaced while the
    plan was being measured; the create-only commit refuses one committed meanwhile.
    No cleanup of unreferenced versions: a prepare running now owns its uncommitted one.
    """
    current = load_manifest(dataset_dir)
    if current.version_id != version_id:
        raise DataError(
            f"{storage.display(dataset_dir)}: the dataset changed while planning (version "
            f"{version_id} is now {current.version_id}); run `shardline plan` again"
        )
    updated = current.model_copy(update={"plan": plan})
    updated._sequence = current.sequence
    return commit_manifest(dataset_dir, updated, based_on=current)


# -- retention and cleanup ----------------------------------------------------------------


def prune(dataset_dir: str, retention: RetentionConfig, now: dt.datetime | None = None) -> list[int]:
    """Drop versions `retention` no longer keeps (manifest first, then their shards); the
    dropped sequences. A version is kept while it is one of the newest `retention.versions`
    versions, or was replaced less than `retention.hours` ago: a job started on it may
    still be reading it.
    """
    now = now or dt.datetime.now(dt.timezone.utc)
    manifests = [load_manifest(dataset_dir, seq) for seq in sequences(dataset_dir)]
    newest: list[str] = []
    for m in reversed(manifests):
        if m.version_id not in newest:
            newest.append(m.version_id)
    keep = set(newest[: retention.versions])
    dropped = []
    for m, successor in zip(manifests, manifests[1:]):
        replaced = now - dt.datetime.fromisoformat(successor.created_at)
        if m.version_id in keep or replaced.total_seconds() < retention.hours * 3600:
            continue
        storage.delete(manifest_url(dataset_dir, m.sequence))
        dropped.append(m.sequence)
    remove_unreferenced(dataset_dir)
    return dropped


def remove_unreferenced(dataset_dir: str) -> None:
    """Version directories no committed manifest names, and temp files of interrupted writes."""
    keep = set()
    for seq in sequences(dataset_dir):
        m = load_manifest(dataset_dir, seq)
        keep.add(f"{VERSION_PREFIX}{m.version_id}")
        for info in m.splits.values():
            keep.update(s.path.split("/", 1)[0] for s in info.shards)
    for n in storage.list_dir(dataset_dir):
        if n.startswith(VERSION_PREFIX) and n not in keep:
            storage.delete_tree(storage.join(dataset_dir, n))
        elif n.startswith(".") and n.endswith(".tmp"):
            storage.delete(storage.join(dataset_dir, n))
    for n in storage.list_dir(storage.join(dataset_dir, MANIFESTS)):
        if n.startswith(".") and n.endswith(".tmp"):
            storage.delete(storage.join(dataset_dir, MANIFESTS, n))


def _ours(n: str) -> bool:
    return (
        n in (MANIFEST_NAME, MANIFESTS, LEASE_NAME, FORECAST_NAME, "_staging")  # _staging: pipelines.frames
        or n.startswith(VERSION_PREFIX)
        or (n.startswith(".") and n.endswith(".tmp"))
    )
