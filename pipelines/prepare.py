"""The prepare stage, engine-neutral: validate, fit, split, shard, commit.

An engine (engine_spark, engine_dask) only reads files, maps partitions, finds
duplicate keys and repartitions by (split, shard); parsing, statistics, the
transform and the shard files are the same code on both (rows, transform, shards).
"""

from __future__ import annotations

import datetime as dt
import math
from functools import partial
from typing import Any, Protocol

import pyarrow.parquet as pq

from . import storage
from .config import PipelineConfig
from .errors import DataError
from .lease import LEASE_NAME, Lease
from .manifest import (
    BandwidthPlan,
    FittedStatistics,
    NumericStats,
    ShardInfo,
    ShardManifest,
    SplitInfo,
    TensorSpec,
    check_dataset_dir,
    commit_manifest,
    has_manifest,
    load_manifest,
    new_version_dir,
)
from .rows import BAD_KINDS, Parsed, merge_reports, typed_schema
from .shards import write_shard_groups
from .sources import check_readable, display, list_files
from .splits import SPLITS
from .transform import feature_width


class PrepareEngine(Protocol):
    name: str
    version: str

    def generate(self, cfg: PipelineConfig) -> None:
        """Write the synthetic source as raw Parquet files at cfg.source.path."""

    def read(self, files: list[str], cfg: PipelineConfig) -> Any:
        """A lazy frame of the raw columns plus `_file`."""

    def columns(self, frame) -> list[str]: ...

    def reports(self, frame, fn) -> list[dict]:
        """fn(pandas batch) -> dict, over every batch; the dicts come back to the driver."""

    def parsed(self, frame, fn, schema) -> Any:
        """A lazy frame of fn(pandas batch) -> pandas, with the given Arrow schema."""

    def duplicate_key(self, parsed, key: str, existing: list[str]) -> tuple[int, list[str]] | None:
        """One key seen twice (in `parsed` or also in the `existing` shard files)."""

    def write(self, parsed, shards: dict[str, int], writer) -> list[dict]:
        """Add _shard = _h mod shards[_split], repartition by (_split, _shard), and run
        writer(pa.Table) on each partition; it yields metadata rows."""


def dataset_lease(dataset_dir: str) -> Lease:
    """The dataset's lease: one prepare at a time (take it before an engine starts)."""
    return Lease(storage.join(dataset_dir, LEASE_NAME), "shardline prepare", what="dataset")


def prepare(
    engine: PrepareEngine,
    cfg: PipelineConfig,
    append: bool = False,
    refit: bool = False,
    by_plan: bool = False,
    lease: Lease | None = None,
) -> ShardManifest:
    """Prepare `cfg.source` into `cfg.dataset_dir` and commit; returns the manifest.

    append: add the source as new shards beside the existing ones, statistics
    frozen from the dataset's first version. append + refit: re-prepare every
    source of the dataset plus this one, statistics fitted anew, all shards new.
    by_plan: lay the shards out by the bandwidth plan in the existing dataset's
    manifest (`shardline plan`): train gets shards_per_rank x world_size shards,
    every split gets the plan's rows per row group; the new manifest keeps the plan.
    lease: the dataset's lease (`dataset_lease`), already held; else taken here.
    """
    if lease is None:
        root = storage.resolve(cfg.dataset_dir, "pipelines.dataset_dir")
        check_dataset_dir(root)  # before the lease: nothing of ours goes into a foreign directory
        with dataset_lease(root) as held:
            return prepare(engine, cfg, append, refit, by_plan, lease=held)
    spec = cfg.features
    root = storage.resolve(cfg.dataset_dir, "pipelines.dataset_dir")
    previous = load_manifest(root) if has_manifest(root) else None
    plan = _usable_plan(previous, cfg, root) if by_plan else None
    if plan is not None and append and not refit:
        raise DataError(f"{root}: a plan lays every shard out anew; use it with --append --refit")
    if append:
        if previous is None:
            raise DataError(f"{root}: --append needs an existing dataset; run prepare first")
        if previous.feature_spec != spec:
            raise DataError(
                f"{root}: pipelines.features differ from the dataset's; append needs the same spec"
            )
    if cfg.source.format == "synthetic":
        engine.generate(cfg)

    files = list_files(cfg.source)
    check_readable(files, cfg.source.format)
    sources = [
        {"format": cfg.source.format, "path": display(f)} for f in files
    ]
    if append and refit:
        files = [_url(s["path"]) for s in previous.sources] + files
        sources = previous.sources + sources

    frame = engine.read(files, cfg)
    have = engine.columns(frame)
    required = [spec.label, *spec.numeric, *spec.categorical, *spec.vectors]
    for col in required if spec.generate_key else [spec.key, *required]:
        if col not in have:
            raise DataError(
                f"{display(cfg.source.path)}: column '{col}' not found "
                f"(have: {', '.join(c for c in have if not c.startswith('_'))})"
            )

    drop = cfg.source.on_bad_rows == "drop"
    report = merge_reports(
        engine.reports(frame, partial(_report_batch, cfg=cfg, drop=drop))
    )
    _check(report, cfg)

    frozen = append and not refit  # statistics and existing shards stay as they are
    existing = (
        [storage.join(root, s.path) for info in previous.splits.values() for s in info.shards]
        if frozen
        else []
    )
    parsed = engine.parsed(frame, partial(_parse_batch, cfg=cfg, drop=drop), typed_schema(spec))
    dup = engine.duplicate_key(parsed, spec.key, existing)
    if dup:
        key, where = dup
        raise DataError(
            f"{', '.join(display(w) for w in where[:3])}: duplicate key {key} in column '{spec.key}'"
        )

    stats = previous.statistics if frozen else _fit(report, cfg)
    row_bytes = 4 * feature_width(spec) + 16
    shards = {s: _shard_count(report["rows"][s], row_bytes, cfg) for s in SPLITS}
    layout = cfg.layout
    if plan is not None:
        # Only train is laid out for loading bandwidth: val and test are read once per
        # epoch for evaluation, so they keep the size rule (and get the row groups).
        shards["train"] = _planned_train_shards(report["rows"]["train"], plan, cfg)
        layout = layout.model_copy(update={"rows_per_row_group": plan.rows_per_row_group})
    offsets = {s: len(previous.splits[s].shards) for s in SPLITS} if frozen else {}

    version_id, version_dir = new_version_dir(root)
    try:
        writer = partial(
            write_shard_groups,
            dataset_dir=root,
            version_dir_name=storage.name(version_dir),
            spec=spec,
            stats=stats,
            rows_per_row_group=layout.rows_per_row_group,
            shard_offsets=offsets,
        )
        metas = engine.write(parsed, shards, writer)
        if not metas:
            raise DataError(f"{display(cfg.source.path)}: no rows left to write")
        splits = {s: _split_info(metas, s) for s in SPLITS}
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
                for f in pq.read_schema(storage.open_input(storage.join(root, metas[0]["path"])))
            ],
            feature_spec=spec,
            tensors={
                "features": TensorSpec(column="features", dtype="float32", shape=[feature_width(spec)]),
                "label": TensorSpec(
                    column=spec.label,
                    dtype="int64" if spec.task == "classification" else "float32",
                    shape=[],
                ),
            },
            statistics=stats,
            layout=layout,
            splits=splits,
            # A plain append keeps the existing shards, so their plan still describes them.
            plan=plan if plan is not None else (previous.plan if frozen else None),
            dropped_rows=report["dropped"],
        )
        lease.check()  # a prepare that stalled past its lease must not commit over another's
        return commit_manifest(root, manifest, based_on=previous, retention=cfg.retention)
    except BaseException:
        storage.delete_tree(version_dir)
        raise


def _report_batch(batch, cfg: PipelineConfig, drop: bool) -> dict:
    parsed = Parsed(batch, cfg.features)
    return parsed.report(cfg.split, cfg.features.categorical_encoding, drop)


def _parse_batch(batch, cfg: PipelineConfig, drop: bool):
    return Parsed(batch, cfg.features).frame(cfg.split, drop_bad=drop)


_WHAT = {
    "bad": "value does not parse as the column's type (pipelines.source.on_bad_rows = 'drop' skips such rows)",
    "null_key": "key is null",
    "null_label": "label is null",
    "negative_label": "class label is negative (classes are 0..K-1)",
    "invalid": "feature is NaN, inf or null (pipelines.features.on_invalid_features = 'impute' fills it)",
}


def _check(report: dict, cfg: PipelineConfig) -> None:
    kinds = [k for k in BAD_KINDS if cfg.source.on_bad_rows == "fail"]
    if cfg.features.on_invalid_features == "fail":
        kinds.append("invalid")
    for kind in kinds:
        for col, p in report["problems"].get(kind, {}).items():
            raise DataError(
                f"{display(p['file'])}: column '{col}', key {p['key']!r}: value {p['value']!r}: "
                f"{_WHAT[kind]} ({p['count']} row(s) like this)"
            )
    total = sum(report["rows"].values())
    if total == 0:
        extra = f" after dropping {report['dropped']} bad row(s)" if report["dropped"] else ""
        raise DataError(f"{display(cfg.source.path)}: input has no rows{extra}")
    if report["rows"]["train"] == 0:
        raise DataError(f"{display(cfg.source.path)}: no row falls in the train split")


def _fit(report: dict, cfg: PipelineConfig) -> FittedStatistics:
    spec = cfg.features
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
    classes = int(report.get("label_max", 0)) + 1 if spec.task == "classification" else 1
    return FittedStatistics(
        numeric=numeric, categorical=categorical, cardinality=cardinality, num_classes=classes
    )


def _shard_count(rows: int, row_bytes: int, cfg: PipelineConfig) -> int:
    if rows == 0:
        return 0
    w = cfg.layout.world_size
    wanted = max(1, math.ceil(rows * row_bytes / cfg.layout.target_shard_bytes))
    return w * math.ceil(wanted / w)


def check_plan(cfg: PipelineConfig) -> BandwidthPlan:
    """The plan `prepare(..., by_plan=True)` would use, or its DataError (before an engine starts)."""
    root = storage.resolve(cfg.dataset_dir, "pipelines.dataset_dir")
    return _usable_plan(load_manifest(root) if has_manifest(root) else None, cfg, root)


def _usable_plan(previous: ShardManifest | None, cfg: PipelineConfig, root: str) -> BandwidthPlan:
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


def _url(path: str) -> str:
    return path if "://" in path else f"file://{path}"
