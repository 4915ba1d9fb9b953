"""What to score: input units (one file each) and the transform that turns them into features.

An input is a prepared dataset (its manifest names the shards of each split:
features are already computed) or raw Parquet files with the training feature
columns (the training dataset's fitted statistics transform them, so serving
cannot skew from training). Everything here only reads: a bad input is found
before anything is written.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from pipelines.config import FeatureSpec
from pipelines.errors import DataError, ShardlineError
from pipelines.manifest import FittedStatistics, ShardManifest, load_manifest, manifest_path

from .models import ResolvedModel


@dataclass(frozen=True)
class Transform:
    """The training data's feature spec and statistics, as JSON so tasks ship them cheaply."""

    spec_json: str
    stats_json: str
    width: int

    @classmethod
    def of(cls, manifest: ShardManifest) -> Transform:
        return cls(
            manifest.feature_spec.model_dump_json(),
            manifest.statistics.model_dump_json(),
            manifest.tensors["features"].shape[0],
        )

    @property
    def spec(self) -> FeatureSpec:
        return FeatureSpec.model_validate_json(self.spec_json)

    @property
    def stats(self) -> FittedStatistics:
        return FittedStatistics.model_validate_json(self.stats_json)


@dataclass(frozen=True)
class Unit:
    """One input file; `kind` is "shard" (prepared features) or "raw" (feature columns)."""

    path: str
    kind: str
    fingerprint: str
    rows: int | None = None  # known without reading for shards (the manifest says)

    @property
    def unit_id(self) -> str:
        return hashlib.sha256(self.path.encode()).hexdigest()[:16]


def training_manifest(model: ResolvedModel, tracking_uri: str) -> ShardManifest | None:
    """The manifest of the dataset the model was trained on (its run's `dataset_dir`)."""
    if not model.run_id:
        return None
    from mlflow.tracking import MlflowClient

    params = MlflowClient(tracking_uri).get_run(model.run_id).data.params
    dataset_dir = params.get("dataset_dir")
    if not dataset_dir or not manifest_path(dataset_dir).is_file():
        return None
    return load_manifest(dataset_dir)


def discover(
    input_path: str, split: str, model: ResolvedModel, tracking_uri: str
) -> tuple[list[Unit], Transform]:
    """The input's units and the transform to apply to them."""
    trained_on = training_manifest(model, tracking_uri)
    root = Path(input_path)
    if root.is_dir() and manifest_path(root).is_file():
        manifest = load_manifest(root)
        if trained_on is not None and (
            manifest.feature_spec != trained_on.feature_spec
            or manifest.statistics != trained_on.statistics
        ):
            raise DataError(
                f"{root}: prepared with other features or statistics than the data model "
                f"{model.uri} was trained on; score its raw files instead"
            )
        base = root.resolve()
        units = [
            Unit(str(base / s.path), "shard", s.sha256, s.rows) for s in manifest.split(split).shards
        ]
        return units, Transform.of(manifest)
    if trained_on is None:
        raise ShardlineError(
            f"model {model.uri}: the dataset it was trained on (run param dataset_dir) is not "
            f"readable, so raw input cannot be transformed; score a prepared dataset instead"
        )
    files = _raw_files(input_path)
    units = []
    for f in files:
        st = os.stat(f)
        units.append(Unit(f, "raw", f"{st.st_size}-{st.st_mtime_ns}"))
    return units, Transform.of(trained_on)


def _raw_files(input_path: str) -> list[str]:
    p = Path(input_path)
    if p.is_file():
        return [str(p.resolve())]
    if p.is_dir():
        found = [
            q for q in p.rglob("*.parquet")
            if not any(part.startswith(("_", ".")) for part in q.relative_to(p).parts)
        ]
    else:
        found = [Path(q) for q in glob.glob(input_path, recursive=True) if Path(q).is_file()]
        if not found:
            raise DataError(f"{input_path}: input not found")
    if not found:
        raise DataError(f"{input_path}: input is empty (no Parquet files)")
    return sorted(str(q.resolve()) for q in found)


def check_unit(unit: Unit, transform: Transform) -> int:
    """Rows of `unit`, after checking from its footer that it has the columns we need."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(unit.path)
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{unit.path}: unreadable Parquet file ({str(e).splitlines()[0]})") from None
    spec = transform.spec
    if unit.kind == "shard":
        need = {spec.key: pa.types.is_integer, "features": _is_numeric_list}
    else:
        need = {spec.key: pa.types.is_integer}
        need.update({c: _is_number for c in spec.numeric})
        need.update({c: _is_category for c in spec.categorical})
        need.update({c: _is_numeric_list for c in spec.vectors})
    for col, ok in need.items():
        if col not in schema.names:
            raise DataError(f"{unit.path}: missing feature column '{col}'")
        if not ok(schema.field(col).type):
            raise DataError(
                f"{unit.path}: column '{col}' has type {schema.field(col).type}, "
                f"which is not a valid type for it"
            )
    return meta.num_rows


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)


def _is_category(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) or pa.types.is_null(t)


def _is_numeric_list(t: pa.DataType) -> bool:
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return is_list and _is_number(t.value_type)
