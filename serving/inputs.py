"""What to score: input units (one file each) and the transform that turns them into features.

An input is a prepared dataset (its manifest names the shards of each split:
features are already computed) or raw Parquet files with the training feature
columns (the training dataset's fitted statistics transform them, so serving
cannot skew from training). Everything here only reads: a bad input is found
before anything is written.

A dataset with tensor or image columns (`feature_spec.typed`) is scored from its
prepared shards: each input tensor is read and decoded as the loader does
(training.loader.columns) and the model is called with the named tensors. Raw input
of such a model is refused: its tensors and images would need prepare's parsing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from shardline.foundation import storage
from shardline.pipelines.config import FeatureSpec, SourceConfig
from shardline.foundation.errors import DataError, ShardlineError, first_line
from shardline.pipelines.manifest import (
    FittedStatistics,
    ShardManifest,
    TensorSpec,
    has_manifest,
    load_manifest,
    sequences,
)
from shardline.pipelines.sources import list_files

from .models import ResolvedModel

# Imported inside the functions that use them: MLflow (~2.5 s: only where MLflow is called).


@dataclass(frozen=True)
class Transform:
    """The training data's feature spec and statistics, as JSON so tasks ship them cheaply."""

    spec_json: str
    stats_json: str
    width: int  # of the features tensor; 0 when the dataset has none (typed columns only)
    # The model's input tensors, {name: TensorSpec} as JSON, for a dataset with typed
    # columns; "" for a tabular one (its input is the features tensor alone).
    tensors_json: str = ""
    # A loop's model (serving.model_io): its own inputs and output, as JSON; "": the dataset's.
    io_json: str = ""

    @property
    def io(self) -> dict:
        return json.loads(self.io_json) if self.io_json else {}

    @classmethod
    def of(cls, manifest: ShardManifest) -> Transform:
        features = manifest.tensors.get("features")
        tensors = {n: t.model_dump(mode="json") for n, t in manifest.tensors.items() if n != "label"}
        return cls(
            manifest.feature_spec.model_dump_json(),
            manifest.statistics.model_dump_json(),
            features.shape[0] if features is not None else 0,
            json.dumps(tensors) if manifest.feature_spec.typed else "",
        )

    @property
    def tensors(self) -> dict[str, TensorSpec] | None:
        """The named input tensors (a dataset with typed columns), in shard column order; None
        for a tabular dataset, whose model takes the features tensor."""
        if not self.tensors_json:
            return None
        return {n: TensorSpec.model_validate(t) for n, t in json.loads(self.tensors_json).items()}

    @property
    def spec(self) -> FeatureSpec:
        return FeatureSpec.model_validate_json(self.spec_json)

    @property
    def stats(self) -> FittedStatistics:
        return FittedStatistics.model_validate_json(self.stats_json)


@dataclass(frozen=True)
class Unit:
    """One input file (a URL); `kind` is "shard" (prepared features) or "raw" (feature columns)."""

    path: str
    kind: str
    fingerprint: str
    rows: int | None = None  # known without reading for shards (the manifest says)

    @property
    def unit_id(self) -> str:
        return hashlib.sha256(self.path.encode()).hexdigest()[:16]


def training_manifest(model: ResolvedModel, tracking_uri: str) -> ShardManifest | None:
    """The manifest of the dataset version the model was trained on (its run's params)."""
    if not model.run_id:
        return None
    from mlflow.tracking import MlflowClient

    params = MlflowClient(tracking_uri).get_run(model.run_id).data.params
    dataset_dir = params.get("dataset_dir")
    if not dataset_dir or not has_manifest(dataset_dir):
        return None
    seq = params.get("dataset_sequence")
    if seq is not None and int(seq) in sequences(dataset_dir):
        return load_manifest(dataset_dir, int(seq))
    return load_manifest(dataset_dir)


def list_units(input_path: str, split: str) -> list[Unit]:
    """The input's units, without a model: a prepared dataset's split (its newest version)
    or raw Parquet files."""
    root = storage.resolve(input_path, "--input")
    if has_manifest(root):
        return [Unit(storage.join(root, s.path), "shard", s.sha256, s.rows)
                for s in load_manifest(root).split(split).shards]
    units = []
    for f in _raw_files(input_path):
        info = storage.file_info(f)
        units.append(Unit(f, "raw", f"{info.size}-{info.mtime_ns}"))
    return units


def discover(
    input_path: str, split: str, model: ResolvedModel, tracking_uri: str
) -> tuple[list[Unit], Transform]:
    """The input's units and the transform to apply to them. A prepared dataset is read
    at its newest version now, and its units name that version's shards: a prepare
    committing meanwhile does not change what this job scores."""
    trained_on = training_manifest(model, tracking_uri)
    root = storage.resolve(input_path, "--input")
    if has_manifest(root):
        manifest = load_manifest(root)
        if trained_on is not None and (
            manifest.feature_spec != trained_on.feature_spec
            or manifest.statistics != trained_on.statistics
        ):
            cols = spec_difference(manifest.feature_spec, trained_on.feature_spec)
            what = (f"other feature columns ({', '.join(repr(c) for c in cols)} differ)" if cols
                    else "other features or statistics")
            raise DataError(
                f"{storage.display(root)}: prepared with {what} than the data model {model.uri} "
                f"(version {model.version}) was trained on; score its raw files instead"
            )
        units = [
            Unit(storage.join(root, s.path), "shard", s.sha256, s.rows) for s in manifest.split(split).shards
        ]
        return units, Transform.of(manifest)
    if trained_on is None:
        raise ShardlineError(
            f"model {model.uri}: the dataset it was trained on (run param dataset_dir) is not "
            f"readable, so raw input cannot be transformed; score a prepared dataset instead"
        )
    if trained_on.feature_spec.typed and model.io.get("inputs") is None:
        typed = [*trained_on.feature_spec.tensors, *trained_on.feature_spec.images]
        raise DataError(
            f"{input_path}: model {model.uri} takes tensor or image columns "
            f"({', '.join(repr(c) for c in typed)}), which only prepare parses and checks: "
            "prepare the raw files (pipelines.source) and score the prepared dataset"
        )
    return list_units(input_path, split), Transform.of(trained_on)


def _raw_files(input_path: str) -> list[str]:
    """Parquet files of a file, directory or glob (local or a URL); names without file://."""
    try:
        files = list_files(SourceConfig(format="parquet", path=input_path))
    except DataError as e:
        if "no parquet files" in str(e):
            raise DataError(f"{input_path}: input is empty (no Parquet files)") from None
        raise
    return [storage.local_path(f) for f in files]  # opened later: not display's masked text


def check_unit(unit: Unit, transform: Transform, for_model: str = "") -> int:
    """Rows of `unit`, after checking from its footer that it has the columns we need;
    every missing or mistyped column is named at once. for_model: "model M version V"."""
    try:
        with storage.open_input(unit.path) as f:
            meta = pq.read_metadata(f)
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{unit.path}: unreadable Parquet file ({first_line(e)})") from None
    spec = transform.spec
    tensors = transform.tensors
    if transform.io.get("inputs") is not None:  # a loop's model of its own inputs
        need = {spec.key: pa.types.is_integer, **own_input_columns(unit.kind, transform.io["inputs"], tensors)}
    elif unit.kind == "shard" and tensors is not None:
        need = {spec.key: pa.types.is_integer}
        need.update({t.column: _stored_as(t) for t in tensors.values()})
    elif unit.kind == "shard":
        need = {spec.key: pa.types.is_integer, "features": _is_numeric_list}
    else:
        need = {spec.key: pa.types.is_integer}
        need.update({c: _is_number for c in spec.numeric})
        need.update({c: _is_category for c in spec.categorical})
        need.update({c: _is_numeric_list for c in spec.vectors})
    missing = [c for c in need if c not in schema.names]
    wrong = [f"'{c}' has type {schema.field(c).type}" for c, ok in need.items()
             if c in schema.names and not ok(schema.field(c).type)]
    takes = f" that {for_model} takes" if for_model else ""
    problems = []
    if missing:
        s = "s" if len(missing) > 1 else ""
        problems.append(f"missing feature column{s} {', '.join(repr(c) for c in missing)}{takes}")
    if wrong:
        problems.append(f"column {', '.join(wrong)}, not a valid type for {'them' if len(wrong) > 1 else 'it'}")
    if problems:
        raise DataError(f"{unit.path}: {'; '.join(problems)}")
    return meta.num_rows


def own_input_columns(kind: str, inputs: dict, tensors: dict[str, TensorSpec] | None) -> dict:
    """A loop model's own inputs (training.loop.io) as the columns a unit must have: a typed
    shard's tensor column as prepare stored it, the shards' `features`, else each input a
    list of numbers per row (a scalar input: a number)."""
    need = {}
    for name, t in inputs.items():
        if kind == "shard" and tensors and name in tensors:
            need[tensors[name].column] = _stored_as(tensors[name])
        else:
            need[name] = _is_numeric_list if t["shape"] else _is_number
    return need


def spec_difference(a: FeatureSpec, b: FeatureSpec) -> list[str]:
    """Columns whose role differs between two feature specs (added, dropped, retyped)."""
    def roles(spec: FeatureSpec) -> dict[str, str]:
        r = {c: "numeric" for c in spec.numeric}
        r.update({c: "categorical" for c in spec.categorical})
        r.update({c: f"vector[{n}]" for c, n in spec.vectors.items()})
        return r

    ra, rb = roles(a), roles(b)
    return sorted(c for c in ra.keys() | rb.keys() if ra.get(c) != rb.get(c))


def _stored_as(tensor: TensorSpec):
    """The Arrow type check of a typed shard column (pipelines.tensors, pipelines.images)."""
    if tensor.encoding == "raw":
        return pa.types.is_fixed_size_binary
    if tensor.encoding == "image":
        return lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t)
    return _is_numeric_list


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)


def _is_category(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) or pa.types.is_null(t)


def _is_numeric_list(t: pa.DataType) -> bool:
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return is_list and _is_number(t.value_type)
