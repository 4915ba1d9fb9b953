"""What prepare settles on the driver before an engine starts, in seconds.

The input's files and columns (Parquet footers, CSV headers, the first JSON lines),
the feature spec resolved against them (a list the user left out is inferred from
the schema, and said so), the classes, a synthetic source's target, and the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from .config import FeatureSpec, PipelineConfig
from shardline.foundation.errors import ConfigError, DataError
from .manifest import BandwidthPlan, ShardManifest, has_manifest, load_manifest
from .raw import RawFile, describe, sniff
from .rows import numbers
from .source_config import SPARK_FORMATS, TABLE_FORMATS
from .sources import display, list_files, open_raw
from shardline.foundation import storage
from . import synthetic
from .images import check_image, class_names, path_keys, read_images
from .problems import typed_problem
from .shard_counts import usable_plan
from .tensors import parse_tensor


@dataclass
class CheckedInput:
    spec: FeatureSpec  # every column named
    files: list[RawFile]  # described; empty for a synthetic source not generated yet
    previous: ShardManifest | None  # the dataset there now
    plan: BandwidthPlan | None  # with --plan
    notes: list[str] = field(default_factory=list)  # what was inferred, for the user
    # The manifest's records of the input when it is not a list of files (a table and its
    # version: pipelines.tables), and the settings that pin the version that was read.
    sources: list[dict] | None = None
    pinned: dict = field(default_factory=dict)


def check_prepare(cfg: PipelineConfig, append: bool = False, refit: bool = False, by_plan: bool = False,
                  frame: bool = False, reads_tables: bool = False) -> CheckedInput:
    """Everything prepare can check without an engine; DataError/ConfigError on the first problem.

    frame: the input is a DataFrame given to prepare (or a Spark table or query, read
    through the engine): its columns are checked once the engine has it (pipelines.frames).
    reads_tables: pipelines.engine reads Spark catalog tables and SQL (the API asks the
    engine's class: shardline.engines.base.Engine.reads_tables)."""
    root = storage.resolve(cfg.dataset_dir, "pipelines.dataset_dir")
    previous = load_manifest(root) if has_manifest(root) else None
    plan = _check_modes(cfg, root, previous, append, refit, by_plan)
    src = cfg.source
    spec = cfg.features
    if append:
        spec = _fill(spec, previous.feature_spec)  # unset settings: the dataset's
    if frame or src.format in SPARK_FORMATS:
        if not reads_tables and not frame:
            raise ConfigError(f"pipelines.source.format = '{src.format}' reads through a Spark session: it needs "
                              f"pipelines.engine = 'spark' (the {cfg.engine} engine has no Spark catalog or SQL)")
        return CheckedInput(spec, [], previous, plan)
    files: list[RawFile] = []
    sources, pinned = None, {}
    if src.format in TABLE_FORMATS:
        from .tables import check_columns, read_input

        ti = read_input(src, previous.sources if append and not refit else None)
        files, names, sources, pinned = ti.files, list(ti.schema.names), [ti.source], ti.pinned
        spec, notes = _resolve(spec, names, _kinds(RawFile(ti.where, "parquet", ti.schema), ",", []), ti.where)
        check_columns(spec, ti)
    elif src.format == "synthetic":
        files, names, spec, notes = _synthetic_input(cfg, spec, append)
    elif src.format == "images":
        files = describe(list_files(src), src.format, src.csv_delimiter)
        spec, notes = _images_spec(spec, files[0], src.path)
        names = list(files[0].schema.names)
        if src.on_bad_rows == "fail":
            _check_first_image(spec, files[0])
    else:
        files = describe(list_files(src), src.format, src.csv_delimiter)
        names = list(files[0].schema.names)
        kinds = _kinds(files[0], src.csv_delimiter, spec.null_values)
        where = display(files[0].url)
        spec, notes = _resolve(spec, names, kinds, where)
    _check_columns(spec, files, names, src.format)
    if spec.tensors and src.format == "parquet" and src.on_bad_rows == "fail":
        _check_first_tensors(spec, files[0])
    if append and spec != previous.feature_spec:
        raise DataError(
            f"{root}: pipelines.features differ from the dataset's; append needs the same spec"
        )
    return CheckedInput(spec, files, previous, plan, notes, sources, pinned)


def _check_modes(cfg: PipelineConfig, root: str, previous: ShardManifest | None, append: bool, refit: bool,
                 by_plan: bool) -> BandwidthPlan | None:
    """The plan to lay shards out by (with by_plan); DataError/ConfigError for a way of
    preparing that the dataset there or the source cannot take."""
    plan = usable_plan(previous, cfg, root) if by_plan else None
    if plan is not None and append and not refit:
        raise DataError(f"{root}: a plan lays every shard out anew; use it with --append --refit")
    if append and previous is None:
        raise DataError(f"{root}: --append needs an existing dataset; run prepare first")
    src = cfg.source
    if cfg.features.task == "next_token" and src.format in ("synthetic", "images"):
        raise ConfigError(
            f"pipelines.features.task = 'next_token' reads a column of token ids; the {src.format} source "
            "has none (use parquet, csv or json input)"
        )
    return plan


def _synthetic_input(cfg: PipelineConfig, spec: FeatureSpec,
                     append: bool) -> tuple[list[RawFile], list[str], FeatureSpec, list[str]]:
    """The synthetic source's files (none until generated), columns, spec and notes: its
    columns are those the generator writes."""
    src = cfg.source
    files: list[RawFile] = []
    have = synthetic.check_target(src.synthetic, storage.resolve(src.path, "pipelines.source.path")) and list_files(src)
    if have:
        files = describe(have, src.format, src.csv_delimiter)
    generated = synthetic.columns(src.synthetic)
    spec = _fill(spec, generated)
    kinds = {c: "numeric" for c in generated.numeric} | {c: "text" for c in generated.categorical}
    names = [generated.key, *kinds, generated.label]
    where = f"the synthetic source ({src.path})"
    notes = _inferred(cfg.features, spec, where) if not append else []
    return files, names, spec, notes


def _images_spec(spec: FeatureSpec, folder: RawFile, path: str) -> tuple[FeatureSpec, list[str]]:
    """The images source's columns: key, path, label (the class folder), image. Classes are
    the class folders' names, sorted, unless declared."""
    if not spec.images:
        raise ConfigError(
            "pipelines.features.images: declare the image column of the images source, "
            "e.g. image = {shape = [3, 32, 32]}"
        )
    update = {f: v for f, v in (("key", "key"), ("label", "label"), ("numeric", []), ("categorical", []))
              if getattr(spec, f) is None}
    if spec.classes is None and spec.task == "classification":
        update["classes"] = class_names(list(folder.files), folder.url)
    resolved = spec.model_copy(update=update)
    notes = _inferred(spec, resolved, f"the images source ({path})")
    if "classes" in update:
        notes.append(f"pipelines.features.classes = {', '.join(update['classes'])}  (the class folders of {path})")
    return resolved, notes


def _check_first_image(spec: FeatureSpec, folder: RawFile) -> None:
    """The folder's first image decoded on the driver: a declared shape that is not the
    images' size, or an unreadable image, is one line before an engine starts (the tasks
    check every image; this catches the common case in seconds)."""
    col = next(iter(spec.images))
    first = folder.files[0]
    data = read_images(folder.url, (first,), ["image"]).column("image")[0].as_py()
    kind = "bad_image" if data is None else check_image(data, spec.images[col])
    if kind is not None:
        key = int(path_keys([first[len(folder.url) + 1 :]])[0])
        value = "<no file>" if data is None else f"<{len(data)} bytes>"
        raise DataError(f"{display(first)}: column '{col}', key {key}: value {value!r}: "
                        f"{typed_problem(kind, col, spec)}")


def _check_first_tensors(spec: FeatureSpec, first: RawFile, rows: int = 1024) -> None:
    """The first file's first rows of every tensor column parsed on the driver: a shape,
    dtype or token id the declaration refuses is one line before an engine starts, worded
    as the tasks word it (they check every row; this catches the common case in seconds)."""
    keyed = spec.key is not None and spec.key in first.schema.names
    with open_raw(first.url) as f:
        columns = [*([spec.key] if keyed else []), *spec.tensors]
        batch = next(pq.ParquetFile(f).iter_batches(batch_size=rows, columns=columns), None)
    if batch is None:
        return
    for col, t in spec.tensors.items():
        _, problems = parse_tensor(batch.column(col), t, spec.null_values)
        for kind, mask in problems.items():
            what = typed_problem(kind, col, spec)
            if what is not None and mask.any():
                i = int(mask.argmax())
                value = batch.column(col)[i].as_py()
                row = f"key {batch.column(spec.key)[i].as_py()}" if keyed else f"row {i}"
                raise DataError(f"{display(first.url)}: column '{col}', {row}: value {str(value)!r}: {what}")


def _fill(spec: FeatureSpec, base: FeatureSpec) -> FeatureSpec:
    """`spec` with the settings it leaves out taken from `base`."""
    unset = {f: getattr(base, f) for f in ("key", "label", "numeric", "categorical") if getattr(spec, f) is None}
    return spec.model_copy(update=unset)


def _kinds(f: RawFile, delimiter: str, nulls: list[str]) -> dict[str, str]:
    """numeric / text / other per column: Parquet by type; CSV and JSON (all text) by
    whether every value of the first rows parses as a number."""
    kinds = {}
    if f.fmt in ("parquet", "synthetic"):
        for fld in f.schema:
            t = fld.type.value_type if pa.types.is_dictionary(fld.type) else fld.type
            if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
                kinds[fld.name] = "numeric"
            elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_boolean(t):
                kinds[fld.name] = "text"
            else:
                kinds[fld.name] = "other"
        return kinds
    head = sniff(f.url, f.fmt, delimiter)
    for name in head.column_names:
        _, null, bad = numbers(head.column(name), nulls)
        kinds[name] = "other" if null.all() else "text" if bad.any() else "numeric"
    return kinds


def _resolve(given: FeatureSpec, names: list[str], kinds: dict[str, str], where: str):
    have = ", ".join(names)
    spec = given
    if spec.key is None and not spec.generate_key:
        raise ConfigError(
            f"pipelines.features.key is not set: name the input's integer key column "
            f"(columns of {where}: {have}) or set generate_key = true"
        )
    if spec.label is None and spec.task == "next_token":
        token = spec.token_column()
        if token is None:
            found = [c for c, t in spec.tensors.items() if t.vocab_size is not None and len(t.shape) == 1]
            raise ConfigError(
                f"pipelines.features: task = 'next_token' and several token columns ({', '.join(found)}): "
                "set pipelines.features.label to the one to predict" if len(found) > 1 else
                "pipelines.features: task = 'next_token' needs a token column: a 1-D integer tensor with a "
                "vocab_size in pipelines.features.tensors, e.g. tokens = {dtype = \"int32\", shape = [512], "
                "vocab_size = 32000}"
            )
        spec = spec.model_copy(update={"label": token})
    if spec.label is None:
        raise ConfigError(f"pipelines.features.label is not set: name the label column (columns of {where}: {have})")
    key = spec.key or "key"
    named = {key, spec.label, *(spec.numeric or []), *(spec.categorical or []), *spec.vectors, *spec.tensors,
             *spec.images}
    update = {"key": key}
    if spec.numeric is None:
        update["numeric"] = [c for c in names if kinds.get(c) == "numeric" and c not in named]
    if spec.categorical is None:
        update["categorical"] = [c for c in names if kinds.get(c) == "text" and c not in named]
    resolved = spec.model_copy(update=update)
    notes = _inferred(given, resolved, where)
    if not (resolved.numeric or resolved.categorical or resolved.vectors or resolved.typed):
        raise ConfigError(
            f"pipelines.features: no feature column (columns of {where}: {have}); "
            f"set numeric, categorical or vectors"
        )
    return resolved, notes


def _inferred(given: FeatureSpec, resolved: FeatureSpec, where: str) -> list[str]:
    notes = []
    for f in ("key", "label", "numeric", "categorical"):
        if getattr(given, f) is None and not (f == "key" and given.generate_key):
            value = getattr(resolved, f)
            shown = ", ".join(value) if isinstance(value, list) else value
            notes.append(f"pipelines.features.{f} = {shown or '(none)'}  (inferred from {where})")
    return notes


def _check_columns(spec: FeatureSpec, files: list[RawFile], names: list[str], fmt: str) -> None:
    """Every column the spec names is in every file (JSON: in the first rows of each)."""
    required = [spec.label, *spec.numeric, *spec.categorical, *spec.vectors, *spec.tensors, *spec.images]
    if not spec.generate_key:
        required.insert(0, spec.key)
    checked: set[int] = set()
    for f in files or [None]:
        if f is not None and id(f.schema) in checked:  # files of one schema share it (raw.describe)
            continue
        have = list(f.schema.names) if f is not None else names
        if f is not None:
            checked.add(id(f.schema))
        for col in required:
            if col not in have:
                where = display(f.url) if f is not None else "the synthetic source"
                raise DataError(
                    f"{where}: column '{col}' not found (have: {', '.join(have)})"
                )


def declared_classes(spec: FeatureSpec, previous: ShardManifest | None, frozen: bool) -> int | None:
    """Classes labels are checked against: declared, the dataset's on a plain append, else None."""
    if spec.task != "classification":
        return None
    if spec.class_names is not None:
        return len(spec.class_names)
    if spec.classes is not None:
        return int(spec.classes)
    if frozen and previous is not None:
        return previous.statistics.num_classes
    return None

