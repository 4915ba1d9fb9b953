"""The prepare stage on Spark: validate, split by key hash, fit, transform, shard."""

from __future__ import annotations

import datetime as dt
import math
import shutil
import uuid
from pathlib import Path

import pyarrow.parquet as pq

from .config import PipelineConfig, SourceConfig
from .errors import DataError
from .manifest import (
    FittedStatistics,
    NumericStats,
    ShardInfo,
    ShardManifest,
    SplitInfo,
    TensorSpec,
    commit_manifest,
    new_version_dir,
)
from .shards import SHARD_COL, SPLIT_COL, write_shard_groups
from .splits import SPLITS, SHARD_SALT, split_thresholds
from .synthetic import generate_spark

_SHARD_META_DDL = (
    "split string, shard int, path string, rows long, bytes long, row_groups int, sha256 string"
)


def generate_raw_spark(spark, source: SourceConfig, cfg: PipelineConfig) -> Path:
    """Write the synthetic source as raw Parquet at `source.path` (replacing it whole)."""
    out = Path(source.path)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    df = generate_spark(spark, source.synthetic, cfg.features)
    df.write.mode("overwrite").parquet(str(tmp.resolve()))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def read_source_spark(spark, source: SourceConfig):
    path = Path(source.path)
    if not path.exists():
        raise DataError(f"{path}: input not found")
    try:
        return spark.read.parquet(str(path.resolve()))
    except Exception as e:  # Spark wraps the cause; name the input, keep the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: cannot read Parquet input ({first})") from None


def prepare_spark(spark, cfg: PipelineConfig) -> ShardManifest:
    """Prepare `cfg.source` into `cfg.dataset_dir`; returns the committed manifest."""
    from pyspark.sql import functions as F

    spec = cfg.features
    raw = read_source_spark(spark, cfg.source)
    _check_columns(raw, spec, cfg.source.path)

    key = F.col(spec.key)
    # The split is a pure function of the key: same on every engine, re-run and append.
    bucket = F.pmod(F.xxhash64(key.cast("long")), F.lit(10_000))
    t_train, t_val = split_thresholds(cfg.split)
    split = (
        F.when(bucket < t_train, "train").when(bucket < t_val, "val").otherwise("test")
    )
    df = raw.select(spec.key, spec.label, *spec.numeric, *spec.categorical).withColumn(
        SPLIT_COL, split
    )

    counts = {
        r[SPLIT_COL]: r
        for r in df.groupBy(SPLIT_COL)
        .agg(
            F.count("*").alias("rows"),
            F.min(spec.label).alias("lo"),
            F.max(spec.label).alias("hi"),
            F.count(spec.label).alias("labelled"),
        )
        .collect()
    }
    total = sum(r["rows"] for r in counts.values())
    if total == 0:
        raise DataError(f"{cfg.source.path}: input has no rows")
    if "train" not in counts:
        raise DataError(f"{cfg.source.path}: no row falls in the train split")
    if any(r["labelled"] < r["rows"] for r in counts.values()):
        raise DataError(f"{cfg.source.path}: column '{spec.label}' has null labels")
    lo = min(r["lo"] for r in counts.values())
    hi = max(r["hi"] for r in counts.values())
    if lo < 0:
        raise DataError(f"{cfg.source.path}: column '{spec.label}' has a negative class {lo}")

    stats = _fit_statistics(df.filter(F.col(SPLIT_COL) == "train"), spec, int(hi) + 1)

    n_features = len(spec.numeric) + len(spec.categorical)
    row_bytes = 4 * n_features + 16
    shards = {
        s: _shard_count(counts[s]["rows"] if s in counts else 0, row_bytes, cfg)
        for s in SPLITS
    }
    shard_expr = F.lit(0)
    for s, n in shards.items():
        h = F.pmod(F.xxhash64(key.cast("long"), F.lit(SHARD_SALT)), F.lit(n))
        shard_expr = F.when(F.col(SPLIT_COL) == s, h).otherwise(shard_expr)

    parts = []
    for c in spec.numeric:
        st = stats.numeric[c]
        parts.append((F.col(c).cast("double") - st.mean) / st.std)
    for c in spec.categorical:
        vocab = F.create_map(
            *[x for i, v in enumerate(stats.categorical[c]) for x in (F.lit(v), F.lit(i + 1))]
        )
        parts.append(F.coalesce(F.try_element_at(vocab, F.col(c).cast("string")), F.lit(0)))
    out = df.select(
        key.cast("long").alias(spec.key),
        F.array(*[p.cast("float") for p in parts]).alias("features"),
        F.col(spec.label).cast("long").alias(spec.label),
        F.col(SPLIT_COL),
        shard_expr.cast("int").alias(SHARD_COL),
    )

    root = Path(cfg.dataset_dir).resolve()
    version_id, version_dir = new_version_dir(root)
    try:
        writer = _shard_writer(str(root), version_dir.name, spec.key, cfg.layout.rows_per_row_group)
        metas = (
            out.repartition(sum(shards.values()), SPLIT_COL, SHARD_COL)
            .mapInArrow(writer, _SHARD_META_DDL)
            .collect()
        )
        manifest = ShardManifest(
            version_id=version_id,
            created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            engine={"name": "spark", "version": spark.version},
            source={"format": cfg.source.format, "path": str(Path(cfg.source.path).resolve())},
            arrow_schema=[
                {"name": f.name, "type": str(f.type)}
                for f in pq.read_schema(root / metas[0]["path"])
            ],
            feature_spec=spec,
            tensors={
                "features": TensorSpec(column="features", dtype="float32", shape=[n_features]),
                "label": TensorSpec(column=spec.label, dtype="int64", shape=[]),
            },
            statistics=stats,
            layout=cfg.layout,
            splits={s: _split_info(metas, s) for s in SPLITS},
        )
        commit_manifest(root, manifest)
    except BaseException:
        shutil.rmtree(version_dir, ignore_errors=True)
        raise
    return manifest


def _check_columns(raw, spec, where) -> None:
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in raw.schema.fields}
    for col in [spec.key, spec.label, *spec.numeric, *spec.categorical]:
        if col not in fields:
            raise DataError(f"{where}: column '{col}' not found (have: {', '.join(fields)})")
    integral = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)
    for col in (spec.key, spec.label):
        if not isinstance(fields[col], integral):
            raise DataError(
                f"{where}: column '{col}' must be an integer, got {fields[col].simpleString()}"
            )
    for col in spec.numeric:
        if not isinstance(fields[col], T.NumericType):
            raise DataError(
                f"{where}: numeric column '{col}' has type {fields[col].simpleString()}"
            )


def _fit_statistics(train, spec, num_classes: int) -> FittedStatistics:
    from pyspark.sql import functions as F

    numeric = {}
    if spec.numeric:
        aggs = []
        for c in spec.numeric:
            aggs += [F.mean(c).alias(f"m_{c}"), F.stddev_pop(c).alias(f"s_{c}")]
        row = train.agg(*aggs).collect()[0]
        for c in spec.numeric:
            std = row[f"s_{c}"]
            # A constant column carries no signal; std 1 keeps it finite instead of NaN.
            numeric[c] = NumericStats(mean=row[f"m_{c}"], std=std if std and std > 0 else 1.0)
    categorical = {}
    for c in spec.categorical:
        rows = (
            train.where(F.col(c).isNotNull())
            .groupBy(F.col(c).cast("string").alias("v"))
            .count()
            .collect()
        )
        categorical[c] = [r["v"] for r in sorted(rows, key=lambda r: (-r["count"], r["v"]))]
    return FittedStatistics(numeric=numeric, categorical=categorical, num_classes=num_classes)


def _shard_count(rows: int, row_bytes: int, cfg: PipelineConfig) -> int:
    w = cfg.layout.world_size
    wanted = max(1, math.ceil(rows * row_bytes / cfg.layout.target_shard_bytes))
    return w * math.ceil(wanted / w)


def _shard_writer(root: str, version_name: str, key: str, rows_per_row_group: int):
    def write(batches):
        yield from write_shard_groups(batches, root, version_name, key, rows_per_row_group)

    return write


def _split_info(metas, split: str) -> SplitInfo:
    mine = sorted((m for m in metas if m["split"] == split), key=lambda m: m["shard"])
    shards = [
        ShardInfo(
            path=m["path"],
            rows=m["rows"],
            bytes=m["bytes"],
            row_groups=m["row_groups"],
            sha256=m["sha256"],
        )
        for m in mine
    ]
    return SplitInfo(rows=sum(s.rows for s in shards), shards=shards)
