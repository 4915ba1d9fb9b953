"""The baselines of `shardline bench prepare`: the same work written plainly on each engine.

The work, as shardline does it: split rows by a hash of the key (80/10/10), fit
mean/std of the numeric columns and the category vocabulary (most frequent first)
on train, standardise, index categories (0 = unknown), assign each row a shard by
a second hash of the key (shard counts from the rows per split, as shardline
sizes them), move rows to their shard, sort each shard by key and write Parquet
(key, features list<float32>, label). Each baseline uses its engine's own tools:
Spark SQL functions (xxhash64, pmod, an aggregate, a create_map lookup, the
DataFrame writer), dask.dataframe (pandas hashing, dask.compute, a P2P shuffle,
to_parquet), or pyarrow and numpy in one process. None of them parses text,
checks for bad values or repeated keys, or records a manifest; shardline does.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardline.pipelines.config import PipelineConfig
from shardline.pipelines.manifest import FittedStatistics, NumericStats
from shardline.pipelines.rows import categories, split_of
from shardline.pipelines.splits import BUCKETS, split_thresholds
from shardline.pipelines.transform import features, features_column

# Imported inside the functions that use them: pyspark (only with a Spark session: Dask and local jobs never
# import it); Dask (only with a Dask client).

SPLIT_NAMES = ("train", "val", "test")
SHARD_SEED = 1_234_567


def shard_counts(rows: dict[str, int], cfg: PipelineConfig) -> dict[str, int]:
    """shardline's size rule: shards of about target_shard_bytes, a multiple of world size."""
    width = len(cfg.features.numeric) + len(cfg.features.categorical)
    row_bytes = 4 * width + 16
    out = {}
    for s in SPLIT_NAMES:
        n = rows.get(s, 0)
        wanted = max(1, math.ceil(n * row_bytes / cfg.layout.target_shard_bytes))
        w = cfg.layout.world_size
        out[s] = w * math.ceil(wanted / w) if n else 0
    return out


def native_spark(spark, raw: str, out: str, cfg: PipelineConfig) -> None:
    """Spark SQL, as a user would write it."""
    from pyspark.sql import functions as F

    spec = cfg.features
    key, label, (cat,) = spec.key, spec.label, spec.categorical
    t_train, t_val = split_thresholds(cfg.split)
    df = spark.read.parquet(raw)
    bucket = F.pmod(F.xxhash64(key), F.lit(BUCKETS))
    df = df.withColumn("split", F.when(bucket < t_train, "train").when(bucket < t_val, "val").otherwise("test"))

    train = df.where(F.col("split") == "train")
    moments = train.agg(
        *[F.avg(c).alias(f"mean_{c}") for c in spec.numeric],
        *[F.stddev_pop(c).alias(f"std_{c}") for c in spec.numeric],
    ).first()
    groups = df.groupBy("split", cat).count().collect()
    rows = {s: sum(r["count"] for r in groups if r["split"] == s) for s in SPLIT_NAMES}
    vocab = sorted(
        ((r["count"], r[cat]) for r in groups if r["split"] == "train" and r[cat] is not None),
        key=lambda t: (-t[0], t[1]),
    )
    index = F.create_map(*[x for i, (_, v) in enumerate(vocab) for x in (F.lit(v), F.lit(i + 1))])

    feats = [((F.col(c) - moments[f"mean_{c}"]) / moments[f"std_{c}"]).cast("float") for c in spec.numeric]
    feats.append(F.coalesce(index[F.col(cat)], F.lit(0)).cast("float"))
    n = shard_counts(rows, cfg)
    h = F.xxhash64(key, F.lit(SHARD_SEED))
    shard = F.when(F.col("split") == "train", F.pmod(h, F.lit(max(n["train"], 1))))
    shard = shard.when(F.col("split") == "val", F.pmod(h, F.lit(max(n["val"], 1))))
    shard = shard.otherwise(F.pmod(h, F.lit(max(n["test"], 1))))
    (
        df.select(key, F.array(*feats).alias("features"), label, "split", shard.alias("shard"))
        .repartition(sum(n.values()), "split", "shard")
        .sortWithinPartitions("split", "shard", key)
        .write.partitionBy("split", "shard")
        .parquet(out)
    )


def native_dask(raw: str, out: str, cfg: PipelineConfig) -> None:
    """dask.dataframe, as a user would write it (on the client's default Dask cluster)."""
    import dask
    import dask.dataframe as dd

    spec = cfg.features
    key, label, (cat,) = spec.key, spec.label, spec.categorical
    t_train, t_val = split_thresholds(cfg.split)

    def tag(df: pd.DataFrame) -> pd.DataFrame:
        b = pd.util.hash_pandas_object(df[key], index=False).to_numpy() % np.uint64(BUCKETS)
        return df.assign(split=np.where(b < t_train, "train", np.where(b < t_val, "val", "test")))

    ddf = dd.read_parquet(raw).map_partitions(tag)
    train = ddf[ddf["split"] == "train"]
    mean, std, groups = dask.compute(
        train[spec.numeric].mean(), train[spec.numeric].std(ddof=0), ddf.groupby(["split", cat]).size()
    )
    rows = groups.groupby(level=0).sum().to_dict()
    vocab = sorted(groups.loc["train"].items(), key=lambda kv: (-kv[1], kv[0]))
    index = {v: i + 1 for i, (v, _) in enumerate(vocab)}
    n = shard_counts(rows, cfg)
    fcols = [f"f{i}" for i in range(len(spec.numeric) + 1)]

    def transform(df: pd.DataFrame) -> pd.DataFrame:
        x = ((df[spec.numeric] - mean) / std).to_numpy(np.float32)
        h = pd.util.hash_pandas_object(df[key] + SHARD_SEED, index=False).to_numpy()
        counts = df["split"].map(n).clip(lower=1).to_numpy().astype(np.uint64)
        cols = {key: df[key].to_numpy(), label: df[label].to_numpy(), "split": df["split"].to_numpy(),
                "shard": (h % counts).astype(np.int64)}
        cols.update({f: x[:, i] for i, f in enumerate(fcols[:-1])})
        cols[fcols[-1]] = df[cat].map(index).fillna(0).to_numpy(np.float32)
        return pd.DataFrame(cols)

    def assemble(df: pd.DataFrame) -> pd.DataFrame:
        # The P2P shuffle moves flat columns; the list column is built after it.
        df = df.sort_values(["split", "shard", key])
        x = df[fcols].to_numpy(np.float32)
        return pd.DataFrame({
            key: df[key].to_numpy(),
            "features": pd.arrays.ArrowExtensionArray(features_column(x)),
            label: df[label].to_numpy(),
            "split": df["split"].to_numpy(),
            "shard": df["shard"].to_numpy(),
        })

    flat = ddf.map_partitions(transform, meta=transform(ddf._meta))
    shuffled = flat.shuffle(on=["split", "shard"], npartitions=sum(n.values()))
    final = shuffled.map_partitions(assemble, meta=assemble(flat._meta))
    final.to_parquet(out, partition_on=["split", "shard"], write_index=False)


def native_pyarrow(raw: str, out: Path, cfg: PipelineConfig) -> None:
    """One process, pyarrow and numpy: read everything, one file per split."""
    spec = cfg.features
    table = pq.read_table(raw)
    splits = split_of(table.column(spec.key).to_numpy(), cfg.split)
    train = table.filter(pa.array(splits == "train"))
    numeric = {
        c: NumericStats(mean=float(pc.mean(train[c]).as_py()), std=float(pc.stddev(train[c]).as_py()))
        for c in spec.numeric
    }
    vocab = {}
    for c in spec.categorical:
        counts = pc.value_counts(train[c]).to_pylist()
        vocab[c] = [d["values"] for d in sorted(counts, key=lambda d: (-d["counts"], d["values"]))]
    stats = FittedStatistics(
        numeric=numeric,
        categorical=vocab,
        cardinality={c: len(v) for c, v in vocab.items()},
        num_classes=int(pc.max(table[spec.label]).as_py()) + 1,
    )
    out.mkdir(parents=True)
    for s in SPLIT_NAMES:
        part = table.filter(pa.array(splits == s)).sort_by(spec.key)
        x = features(
            {c: part.column(c).to_numpy() for c in spec.numeric},
            {c: categories(part.column(c), spec.null_values) for c in spec.categorical},
            {},
            part.num_rows,
            spec,
            stats,
            impute=False,
        )
        shard = pa.table({spec.key: part[spec.key], "features": features_column(x), spec.label: part[spec.label]})
        pq.write_table(shard, out / f"{s}.parquet", row_group_size=cfg.layout.rows_per_row_group)
