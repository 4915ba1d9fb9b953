"""The prepare stage, engine-neutral: check, report, fit, shuffle and write, commit.

Two passes over the raw data, each one engine job: pass 1 reads and parses every
unit and reports counts, problems and train-split statistics (no rows move); pass
2 reads and parses again, transforms, shuffles rows to their shard and writes the
shards, finding repeated keys on the way (a key's rows all reach one shard). An
engine (shardline.engines: Spark's, Dask's) only runs tasks and the shuffle; parsing,
statistics, the transform and the shard files are the same code on both (raw,
rows, tasks, transform, shards). What the passes' results refuse is worded in
pipelines.problems; how many shards each split gets, in pipelines.shard_counts.
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
from .problems import check_report, check_repeats
from .shard_counts import shard_parts
from .raw import RawFile, Unit, describe, plan_units
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
    imputed_values,
    merge_reports,
    transport_schema,
)
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
    return _prepare_files(engine, cfg, checked, root, lease, append, refit)


def _prepare_files(engine: PrepareEngine, cfg: PipelineConfig, checked: CheckedInput, root: str, lease: Lease,
                   append: bool, refit: bool) -> ShardManifest:
    """`prepare` of files, once checked with the lease held: pass 1, the statistics and shard
    counts, pass 2 into a new version directory, the manifest committed (the directory removed
    on any failure)."""
    spec, previous = checked.spec, checked.previous
    files, sources = _inputs(engine, cfg, checked, append, refit)
    units = plan_units(files)

    frozen = append and not refit  # statistics and existing shards stay as they are
    task = PrepareTask(
        spec=spec,
        split=cfg.split,
        drop_bad=cfg.source.on_bad_rows == "drop",
        num_classes=declared_classes(spec, previous, frozen),
        delimiter=cfg.source.csv_delimiter,
        rejects_per_unit=rejects.per_unit(len(units)),
    )
    groups = group_units(units)  # a task per group: 100,000 small files are not 100,000 tasks
    report = _report(engine, task, groups, len(units))
    check_report(report, cfg, spec, task.num_classes, frozen)

    stats = previous.statistics if frozen else _fit(report, spec)
    parts, layout = shard_parts(report, spec, cfg, checked.plan)
    offsets = {s: len(previous.splits[s].shards) for s in SPLITS} if frozen else {}
    existing = [storage.join(root, s.path) for info in previous.splits.values() for s in info.shards] if frozen else []

    version_id, version_dir = new_version_dir(root)
    try:
        metas = _shuffle_write(engine, task, stats, parts, groups, existing, len(units), root, version_dir,
                               layout.rows_per_row_group, offsets)
        written = _written(metas, units, existing, spec, cfg.source.path)
        splits = _splits(written, previous if frozen else None)
        accounts = _dropped(report, metas, units, spec, previous.imputed_values if frozen else {}, version_dir)
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
            plan=checked.plan if checked.plan is not None else (previous.plan if frozen else None),
            **accounts,
        )
        lease.check()  # a prepare that stalled past its lease must not commit over another's
        return commit_manifest(root, manifest, based_on=previous, retention=cfg.retention)
    except BaseException:
        storage.delete_tree(version_dir)
        raise


def _inputs(engine: PrepareEngine, cfg: PipelineConfig, checked: CheckedInput, append: bool,
            refit: bool) -> tuple[list[RawFile], list[dict]]:
    """The files to read (a synthetic source generated first) and the manifest's records of them;
    with append + refit, the dataset's earlier sources first."""
    src = cfg.source
    if src.format == "synthetic":
        synthetic.generate(engine, src.synthetic, storage.resolve(src.path, "pipelines.source.path"))
    files = checked.files or describe(list_files(src), src.format, src.csv_delimiter)
    # Read again by --append --refit: the path itself, not display's masked text.
    sources = checked.sources or [{"format": src.format, "path": storage.local_path(f.url)} for f in files]
    if append and refit:
        old, kept = previous_inputs(checked.previous.sources, src, src.csv_delimiter)
        files, sources = old + files, kept + sources
    return files, sources


def _report(engine: PrepareEngine, task: PrepareTask, groups: list, units: int) -> dict:
    """Pass 1: every group's report, merged in unit order (no rows move)."""
    with _listener(engine) as progress, progress.stage("prepare pass 1", units, "units read") as read:
        return merge_reports(engine.run(
            CountedUnits(partial(report_group, task=task, cap=rejects.CAP), progress.address, read.key), groups))


def _shuffle_write(engine: PrepareEngine, task: PrepareTask, stats: FittedStatistics, parts: Parts, groups: list,
                   existing: list[str], units: int, root: str, version_dir: str, rows_per_row_group: int,
                   offsets: dict[str, int]) -> list[dict]:
    """Pass 2: the units (and on an append, the existing shards' keys) read again, routed to
    their part and written as shards into `version_dir`; the written shards' metadata rows."""
    inputs = groups + [(i - len(existing), url) for i, url in enumerate(existing)]
    with (
        _listener(engine) as progress,
        progress.stage("prepare pass 2", units + len(existing), "units read and routed") as routed,
        progress.stage("prepare write", parts.total, "shards written") as shards_out,
    ):
        metas = engine.shuffle_write(
            sources=inputs,
            read=CountedUnits(partial(group_rows, task=task, stats=stats, parts=parts, existing=partial(
                _existing_rows, task=task, parts=parts)), progress.address, routed.key),
            schema=transport_schema(task.spec),
            parts=parts.total,
            # A permanent failure (a full disk) comes back as a row: no engine retries it.
            # Counted inside: a write that failed is not counted as a shard written.
            write=failure_rows(Counted(
                partial(
                    write_parts,
                    parts=parts,
                    dataset_dir=root,
                    version_dir_name=storage.name(version_dir),
                    spec=task.spec,
                    rows_per_row_group=rows_per_row_group,
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
    return metas


def _written(metas: list[dict], units: list[Unit], existing: list[str], spec: FeatureSpec,
             path: str) -> list[dict]:
    """Pass 2's shards written, or the error that stops the commit: a failed write, a
    repeated key, no rows left."""
    failed = next((m["error"] for m in metas if m.get("error")), None)
    if failed:
        raise StorageError(f"pipelines.dataset_dir: {failed} (not retried: trying again cannot fix it)")
    check_repeats(metas, units, existing, spec)
    written = [m for m in metas if m["path"]]
    if not written:
        raise DataError(f"{display(path)}: no rows left to write")
    return written


def _splits(written: list[dict], kept: ShardManifest | None) -> dict[str, SplitInfo]:
    """Each split's rows and shards: those written, after the ones `kept` (a plain append's dataset)."""
    splits = {s: _split_info(written, s) for s in SPLITS}
    if kept is None:
        return splits
    return {
        s: SplitInfo(rows=kept.splits[s].rows + splits[s].rows, shards=kept.splits[s].shards + splits[s].shards)
        for s in SPLITS
    }


def _dropped(report: dict, metas: list[dict], units: list[Unit], spec: FeatureSpec, imputed_before: dict[str, int],
             version_dir: str) -> dict:
    """The manifest's account of rows not kept as they came: dropped, imputed, and the
    rejects file (written into `version_dir`)."""
    dropped = report["dropped"] + sum(m["repeated"] or 0 for m in metas)
    imputed = imputed_values(report, spec, imputed_before)
    kept = rejects.collect(report["rejects"], metas, units, spec.key)
    rejects_path = rejects.write(version_dir, kept)
    return {
        "dropped_rows": dropped,
        "imputed_values": imputed,
        "rejects": RejectsInfo(
            path=f"{storage.name(version_dir)}/{rejects_path}", rows=len(kept), total=dropped, cap=rejects.CAP,
        ) if rejects_path else None,
    }


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


def _split_info(metas: list[dict], split: str) -> SplitInfo:
    mine = sorted((m for m in metas if m["split"] == split), key=lambda m: m["shard"])
    shards = [ShardInfo(**{k: m[k] for k in ("path", "rows", "bytes", "row_groups", "sha256")}) for m in mine]
    return SplitInfo(rows=sum(s.rows for s in shards), shards=shards)

