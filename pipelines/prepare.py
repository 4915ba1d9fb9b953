"""The prepare stage, engine-neutral: check, report, fit, shuffle and write, commit.

Two passes over the raw data, each one engine job: pass 1 reads and parses every
unit and reports counts, problems and train-split statistics (no rows move); pass
2 reads and parses again, transforms, shuffles rows to their shard and writes the
shards, finding repeated keys on the way (a key's rows all reach one shard). An
engine (shardline.engines: Spark's, Dask's) only runs tasks and the shuffle; parsing,
statistics, the transform and the shard files are the same code on both (raw,
rows, tasks, transform, shards).
"""

from __future__ import annotations

import datetime as dt
import math
from functools import partial
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from . import rejects, synthetic
from shardline.foundation import storage
from .checks import CheckedInput, check_prepare, declared_classes
from shardline.foundation.failures import failure_rows
from .config import FeatureSpec, PipelineConfig
from shardline.foundation.errors import DataError, StorageError
from shardline.foundation.lease import LEASE_NAME, Lease
from .manifest import (
    BandwidthPlan,
    FittedStatistics,
    NumericStats,
    RejectsInfo,
    ShardInfo,
    ShardManifest,
    SplitInfo,
    TensorSpec,
    check_dataset_dir,
    commit_manifest,
    new_version_dir,
    sequences,
)
from shardline.foundation.progress import Counted, ProgressListener
from .raw import Unit, describe, plan_units
from .rows import BAD_KINDS, INVALID
from .shards import SHARD_META_SCHEMA, write_parts
from .source_config import SPARK_FORMATS
from .sources import display, list_files
from .tables import previous_inputs
from .unit_groups import CountedUnits, group_rows, group_units, report_group
from .splits import SPLITS
from .tasks import (
    Parts,
    PrepareTask,
    existing_rows,
    first_problem,
    imputed_values,
    merge_reports,
    transport_schema,
)
from .tensors import row_bytes as tensor_bytes
from .transform import feature_width


class PrepareEngine(Protocol):
    """What prepare asks of its engine (shardline.engines.base.Engine, whose docstrings say more)."""

    name: str  # the setting's value, for lines and the manifest
    version: str

    def run(self, fn, items: list) -> list:
        """fn(item) for every item, one task each; JSON-able results in item order."""

    def shuffle_write(self, sources: list, read, schema: pa.Schema, parts: int, write, out_schema: pa.Schema) -> list[dict]:
        """read(source) -> Arrow tables with `_part`; each part's rows meet in one
        write(table) call; the metadata rows it yields come back."""

    def listen_address(self) -> str:
        """Where its tasks reach this process's progress listener."""

    def owns_frame(self, df) -> bool:
        """`df` is a DataFrame of this engine (pipelines.frames)."""

    def stage_frame(self, df, folder: str) -> int:
        """Each partition of its DataFrame `df` written as Parquet into `folder` (pipelines.frames)."""

    def table_frame(self, src):
        """A Spark catalog table's or query's DataFrame (pipelines.frames); ConfigError without one."""


def dataset_lease(dataset_dir: str) -> Lease:
    """The dataset's lease: one prepare at a time (take it before an engine starts)."""
    return Lease(storage.join(dataset_dir, LEASE_NAME), "shardline prepare", what="dataset")


def prepare(
    engine: PrepareEngine,
    cfg: PipelineConfig,
    append: bool = False,
    refit: bool = False,
    by_plan: bool = False,
    checked: CheckedInput | None = None,
    lease: Lease | None = None,
    frame=None,
) -> ShardManifest:
    """Prepare `cfg.source` into `cfg.dataset_dir` and commit; returns the manifest.

    append: add the source as new shards beside the existing ones, statistics
    frozen from the dataset's first version. append + refit: re-prepare every
    source of the dataset plus this one, statistics fitted anew, all shards new.
    by_plan: lay the shards out by the bandwidth plan in the existing dataset's
    manifest (`shardline plan`): train gets shards_per_rank x world_size shards,
    every split gets the plan's rows per row group; the new manifest keeps the plan.
    checked: `check_prepare`'s result, when the caller ran it before starting the engine.
    lease: the dataset's lease (`dataset_lease`), already held; else taken here.
    frame: a Spark or Dask DataFrame to prepare instead of `cfg.source` (pipelines.frames).
    """
    root = storage.resolve(cfg.dataset_dir, "pipelines.dataset_dir")
    if lease is None:
        check_dataset_dir(root)  # before the lease: nothing of ours goes into a foreign directory
        # The lease removes the directory it made: a refused first prepare leaves nothing.
        with dataset_lease(root) as held:
            return prepare(engine, cfg, append, refit, by_plan, checked=checked, lease=held, frame=frame)
    if frame is not None or cfg.source.format in SPARK_FORMATS:
        from .frames import prepare_frame  # staged as Parquet first, then prepared as such

        return prepare_frame(engine, cfg, frame, append, refit, by_plan, lease)
    if checked is None or _moved(checked.previous, root):
        # Checked before the lease was ours: another prepare may have committed since. A table
        # is read again at the version checked first: the driver pins it once.
        pinned = cfg.source.model_copy(update=checked.pinned) if checked is not None else cfg.source
        checked = check_prepare(cfg.model_copy(update={"source": pinned}), append, refit, by_plan)
    spec, previous, plan = checked.spec, checked.previous, checked.plan
    src = cfg.source
    if src.format == "synthetic":
        synthetic.generate(engine, src.synthetic, storage.resolve(src.path, "pipelines.source.path"))
    files = checked.files or describe(list_files(src), src.format, src.csv_delimiter)
    # Read again by --append --refit: the path itself, not display's masked text.
    sources = checked.sources or [{"format": src.format, "path": storage.local_path(f.url)} for f in files]
    if append and refit:
        old, kept = previous_inputs(previous.sources, src, src.csv_delimiter)
        files, sources = old + files, kept + sources
    units = plan_units(files)

    frozen = append and not refit  # statistics and existing shards stay as they are
    task = PrepareTask(
        spec=spec,
        split=cfg.split,
        drop_bad=src.on_bad_rows == "drop",
        num_classes=declared_classes(spec, previous, frozen),
        delimiter=src.csv_delimiter,
        rejects_per_unit=rejects.per_unit(len(units)),
    )
    groups = group_units(units)  # a task per group: 100,000 small files are not 100,000 tasks
    with _listener(engine) as progress, progress.stage("prepare pass 1", len(units), "units read") as read:
        report = merge_reports(engine.run(
            CountedUnits(partial(report_group, task=task, cap=rejects.CAP), progress.address, read.key), groups))
    _check(report, cfg, spec, task.num_classes, frozen)

    stats = previous.statistics if frozen else _fit(report, spec)
    rows = max(1, sum(report["rows"]))
    row_bytes = 4 * feature_width(spec) + 16 + sum(tensor_bytes(t) for t in spec.tensors.values()) \
        + report["payload"] // rows
    counts = {s: _shard_count(n, row_bytes, cfg) for s, n in zip(SPLITS, report["rows"])}
    layout = cfg.layout
    if plan is not None:
        # Only train is laid out for loading bandwidth: val and test are read once per
        # epoch for evaluation, so they keep the size rule (and get the row groups).
        counts["train"] = _planned_train_shards(report["rows"][0], plan, cfg)
        layout = layout.model_copy(update={"rows_per_row_group": plan.rows_per_row_group})
    parts = Parts(tuple(counts[s] for s in SPLITS))
    offsets = {s: len(previous.splits[s].shards) for s in SPLITS} if frozen else {}
    existing = [storage.join(root, s.path) for info in previous.splits.values() for s in info.shards] if frozen else []

    version_id, version_dir = new_version_dir(root)
    try:
        inputs = groups + [(i - len(existing), url) for i, url in enumerate(existing)]
        with (
            _listener(engine) as progress,
            progress.stage("prepare pass 2", len(units) + len(existing), "units read and routed") as routed,
            progress.stage("prepare write", parts.total, "shards written") as shards_out,
        ):
            metas = engine.shuffle_write(
                sources=inputs,
                read=CountedUnits(partial(group_rows, task=task, stats=stats, parts=parts, existing=partial(
                    _existing_rows, task=task, parts=parts)), progress.address, routed.key),
                schema=transport_schema(spec),
                parts=parts.total,
                # A permanent failure (a full disk) comes back as a row: no engine retries it.
                # Counted inside: a write that failed is not counted as a shard written.
                write=failure_rows(Counted(
                    partial(
                        write_parts,
                        parts=parts,
                        dataset_dir=root,
                        version_dir_name=storage.name(version_dir),
                        spec=spec,
                        rows_per_row_group=layout.rows_per_row_group,
                        shard_offsets=offsets,
                        drop_repeats=task.drop_bad,
                    ),
                    progress.address,
                    shards_out.key,
                ), SHARD_META_SCHEMA),
                out_schema=SHARD_META_SCHEMA,
            )
            # One write call per part with rows (a part's rows meet in one partition); one
            # that failed is a part too: "4/6 shards written", then the error.
            shards_out.total = sum(1 for m in metas if m["path"] or m.get("error"))
        failed = next((m["error"] for m in metas if m.get("error")), None)
        if failed:
            raise StorageError(f"pipelines.dataset_dir: {failed} (not retried: trying again cannot fix it)")
        _check_repeats(metas, units, existing, spec)
        written = [m for m in metas if m["path"]]
        if not written:
            raise DataError(f"{display(src.path)}: no rows left to write")
        splits = {s: _split_info(written, s) for s in SPLITS}
        dropped = report["dropped"] + sum(m["repeated"] or 0 for m in metas)
        imputed = imputed_values(report, spec, previous.imputed_values if frozen else {})
        kept = rejects.collect(report["rejects"], metas, units, spec.key)
        rejects_path = rejects.write(version_dir, kept)
        if frozen:
            splits = {
                s: SplitInfo(
                    rows=previous.splits[s].rows + splits[s].rows,
                    shards=previous.splits[s].shards + splits[s].shards,
                )
                for s in SPLITS
            }
        manifest = ShardManifest(
            version_id=version_id,
            created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            engine={"name": engine.name, "version": engine.version},
            sources=(previous.sources if frozen else []) + sources,
            arrow_schema=[
                {"name": f.name, "type": str(f.type)}
                for f in pq.read_schema(storage.open_input(storage.join(root, written[0]["path"])))
            ],
            feature_spec=spec,
            tensors=tensor_specs(spec),
            statistics=stats,
            layout=layout,
            splits=splits,
            # A plain append keeps the existing shards, so their plan still describes them.
            plan=plan if plan is not None else (previous.plan if frozen else None),
            dropped_rows=dropped,
            imputed_values=imputed,
            rejects=RejectsInfo(
                path=f"{storage.name(version_dir)}/{rejects_path}", rows=len(kept), total=dropped, cap=rejects.CAP,
            ) if rejects_path else None,
        )
        lease.check()  # a prepare that stalled past its lease must not commit over another's
        return commit_manifest(root, manifest, based_on=previous, retention=cfg.retention)
    except BaseException:
        storage.delete_tree(version_dir)
        raise


def tensor_specs(spec: FeatureSpec) -> dict[str, TensorSpec]:
    """The manifest's model inputs, in shard column order: what the loader yields."""
    out = {}
    if feature_width(spec) or not spec.typed:
        out["features"] = TensorSpec(column="features", dtype="float32", shape=[feature_width(spec)])
    for c, t in spec.tensors.items():
        out[c] = TensorSpec(column=c, dtype=t.dtype, shape=list(t.shape), encoding="raw")
    for c, im in spec.images.items():
        out[c] = TensorSpec(column=c, dtype="uint8", shape=list(im.shape), encoding="image")
    if spec.task == "next_token":
        # The target is the token column itself (the loader yields it twice, as the input
        # and as "label"): one decoded tensor moves through every strategy as a label does.
        out["label"] = out[spec.label].model_copy()
    else:
        out["label"] = TensorSpec(
            column=spec.label, dtype="int64" if spec.task == "classification" else "float32", shape=[]
        )
    return out


def _listener(engine) -> ProgressListener:
    """The driver's progress listener, where the engine's tasks reach it (foundation.progress):
    the passes' counts show on this console wherever the tasks run."""
    return ProgressListener(engine.listen_address(), drain=False)


def _moved(previous: ShardManifest | None, root: str) -> bool:
    """Whether the dataset's newest manifest is no longer `previous`."""
    newest = sequences(root)
    return (newest[-1] if newest else None) != (previous.sequence if previous else None)


def _existing_rows(source: tuple[int, str], task: PrepareTask, parts: Parts):
    """Pass 2's rows of an existing shard, (negative index, url): its keys, on an append."""
    index, url = source
    return existing_rows(url, index, task.spec, parts, task.split)


_WHAT = {
    "bad": "value does not parse as the column's type (pipelines.source.on_bad_rows = 'drop' skips such rows)",
    "null_key": "key is null",
    "null_label": "label is null",
    "negative_label": "class label is negative (classes are 0..K-1)",
    INVALID: "feature is NaN, inf or null (pipelines.features.on_invalid_features = 'impute' fills it)",
    "bad_image": "not a decodable PNG or JPEG image",
}
_DROP = " (pipelines.source.on_bad_rows = 'drop' skips such rows)"


def _typed_problem(kind: str, col: str, spec: FeatureSpec) -> str | None:
    """What is wrong with a tensor or image value, from its declaration."""
    if col in spec.tensors:
        t = spec.tensors[col]
        if kind == "bad_shape":
            return f"tensor's shape differs from the declared {t.shape}{_DROP}"
        if kind == "bad_dtype":
            return f"tensor's values do not fit the declared dtype {t.dtype}{_DROP}"
        if kind == "out_of_vocab":
            return f"token id outside the vocabulary 0..{t.vocab_size - 1} (vocab_size = {t.vocab_size}){_DROP}"
    if col in spec.images:
        c, h, w = spec.images[col].shape
        if kind == "bad_image":
            return f"{_WHAT[kind]}{_DROP}"
        if kind == "image_size":
            return (f"image is not {h}x{w} (height x width) and pipelines.features.images.{col}.resize "
                    f"is off{_DROP}")
    return None


def _check(report: dict, cfg: PipelineConfig, spec: FeatureSpec, num_classes: int | None, frozen: bool) -> None:
    """The first problem in file and row order, of the kinds the settings make fatal."""
    if "error" in report:
        raise DataError(report["error"])
    kinds = list(BAD_KINDS) if cfg.source.on_bad_rows == "fail" else []
    if spec.on_invalid_features == "fail":
        kinds.append(INVALID)
    first = first_problem(report, kinds)
    if first is not None:
        kind, col, p = first
        if kind == "unknown_label":
            what = (
                f"label is not one of the classes {spec.class_names}" if spec.class_names is not None
                else f"label is outside the dataset's {num_classes} classes 0..{num_classes - 1}" if frozen
                and spec.classes is None
                else f"label is outside pipelines.features.classes = {num_classes} (0..{num_classes - 1})"
            )
        else:
            what = _typed_problem(kind, col, spec) or _WHAT[kind]
        raise DataError(
            f"{display(p['file'])}: column '{col}', key {p['key']!r}: value {p['value']!r}: "
            f"{what} ({report['fatal_rows']} bad row(s) in all)"
        )
    total = sum(report["rows"])
    if total == 0:
        extra = f" after dropping {report['dropped']} bad row(s)" if report["dropped"] else ""
        raise DataError(f"{display(cfg.source.path)}: input has no rows{extra}")
    if report["rows"][0] == 0:
        raise DataError(f"{display(cfg.source.path)}: no row falls in the train split")


def _check_repeats(metas: list[dict], units: list[Unit], existing: list[str], spec: FeatureSpec) -> None:
    """A key seen twice (with on_bad_rows = 'fail'): the repeat met first in unit and row order."""
    repeats = [m for m in metas if m["repeat_key"] is not None]
    if not repeats:
        return
    m = min(repeats, key=lambda m: m["repeat_pos"])

    def file_of(pos: int) -> str:
        index = pos >> 32
        return display(units[index].url if index >= 0 else existing[index])

    files = sorted({file_of(m["first_pos"]), file_of(m["repeat_pos"])})
    raise DataError(
        f"{', '.join(files)}: duplicate key {m['repeat_key']} in column '{spec.key}' "
        f"(pipelines.source.on_bad_rows = 'drop' keeps its first row)"
    )


def _fit(report: dict, spec: FeatureSpec) -> FittedStatistics:
    numeric = {}
    for c in spec.numeric:
        n, mean, m2 = report["moments"].get(c, (0, 0.0, 0.0))
        std = math.sqrt(m2 / n) if n else 0.0
        # A constant column carries no signal; std 1 keeps it finite instead of NaN.
        numeric[c] = NumericStats(mean=mean, std=std if std > 0 else 1.0)
    categorical, cardinality = {}, {}
    for c in spec.categorical:
        if spec.categorical_encoding == "hash":
            categorical[c], cardinality[c] = [], spec.hash_buckets
        else:
            counts = report["categories"].get(c, {})
            categorical[c] = [v for v, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
            cardinality[c] = len(categorical[c])
    label = None
    if spec.task == "next_token":
        classes = spec.tensors[spec.label].vocab_size  # one logit per token id at each position
    elif spec.task == "regression":
        classes = 1
        n, mean, m2 = report.get("label_moments", (0, 0.0, 0.0))
        std = math.sqrt(m2 / n) if n else 0.0
        # Labels all equal: nothing to scale by; 1 keeps the model's output as it is.
        label = NumericStats(mean=mean, std=std if std > 0 else 1.0)
    else:
        classes = declared_classes(spec, None, False) or int(report.get("label_max", 0)) + 1
    return FittedStatistics(
        numeric=numeric, categorical=categorical, cardinality=cardinality, num_classes=classes, label=label
    )


def _shard_count(rows: int, row_bytes: int, cfg: PipelineConfig) -> int:
    if rows == 0:
        return 0
    w = cfg.layout.world_size
    wanted = max(1, math.ceil(rows * row_bytes / cfg.layout.target_shard_bytes))
    return w * math.ceil(wanted / w)


def usable_plan(previous: ShardManifest | None, cfg: PipelineConfig, root: str) -> BandwidthPlan:
    if previous is None or previous.plan is None:
        raise DataError(f"{root}: no bandwidth plan to lay shards out by; run `shardline plan` first")
    plan = previous.plan
    if not (plan.shards_per_rank and plan.rows_per_row_group and plan.world_size):
        raise DataError(f"{root}: the manifest's plan is incomplete; run `shardline plan` again")
    if plan.world_size != cfg.layout.world_size:
        raise DataError(
            f"{root}: the plan is for {plan.world_size} ranks but pipelines.layout.world_size "
            f"is {cfg.layout.world_size}; set training.world_size to match and run `shardline plan` again"
        )
    return plan


def _planned_train_shards(rows: int, plan: BandwidthPlan, cfg: PipelineConfig) -> int:
    wanted = plan.shards_per_rank * cfg.layout.world_size
    if rows < wanted:
        # Hash assignment would leave shards empty and the count off a multiple of world size.
        raise DataError(
            f"{display(cfg.source.path)}: the plan wants {wanted} train shards but the train "
            f"split has {rows} rows; run `shardline plan` on this data again"
        )
    return wanted


def _split_info(metas: list[dict], split: str) -> SplitInfo:
    mine = sorted((m for m in metas if m["split"] == split), key=lambda m: m["shard"])
    shards = [ShardInfo(**{k: m[k] for k in ("path", "rows", "bytes", "row_groups", "sha256")}) for m in mine]
    return SplitInfo(rows=sum(s.rows for s in shards), shards=shards)

