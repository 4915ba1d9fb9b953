"""Deterministic synthetic classification data, generated on the executors/workers.

Every value is a pure function of (key, seed), so the data is the same for any
partitioning and on either engine, and nothing is materialised on the driver.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import storage
from .config import FeatureSpec, SyntheticSource
from .hashing import bucket, uniform

_COLORS = ["red", "green", "blue", "amber", "violet", "teal", "gray", "pink", "cyan", "olive"]


def category_names(n: int) -> list[str]:
    return [_COLORS[i] if i < len(_COLORS) else f"c{i}" for i in range(n)]


def key_ranges(src: SyntheticSource) -> list[tuple[int, int]]:
    """[start, stop) key ranges, one per partition (= raw file)."""
    step = math.ceil(src.rows / src.partitions)
    return [(a, min(a + step, src.rows)) for a in range(0, src.rows, step)]


def generate_rows(start: int, stop: int, src: SyntheticSource, spec: FeatureSpec) -> pd.DataFrame:
    """Rows with keys start..stop-1: key, numeric features, categoricals, label."""
    if len(spec.numeric) != src.numeric_features:
        raise ValueError(
            f"features.numeric names {len(spec.numeric)} columns but "
            f"source.synthetic.numeric_features is {src.numeric_features}"
        )
    keys = np.arange(start, stop, dtype=np.int64)
    salt = src.seed * 1_000_003

    def normal(j):
        u1, u2 = uniform(keys, salt + 2 * j), uniform(keys, salt + 2 * j + 1)
        return np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * math.pi * u2)

    rng = np.random.default_rng(src.seed)
    n, k = src.numeric_features, src.classes
    weights = rng.normal(0, 2.0 / math.sqrt(n), size=(k, n))
    interaction = rng.normal(0, 1.0, size=k)
    cat_bias = rng.normal(0, 1.0, size=(len(spec.categorical), src.categories, k))

    cols: dict[str, np.ndarray] = {spec.key: keys}
    x = np.stack([normal(i) for i in range(n)], axis=1) if n else np.zeros((len(keys), 0))
    for i, name in enumerate(spec.numeric):
        cols[name] = x[:, i]
    logits = x @ weights.T
    if n >= 2:
        logits += (x[:, 0] * x[:, 1])[:, None] * interaction[None, :]
    names = np.array(category_names(src.categories), dtype=object)
    for c, name in enumerate(spec.categorical):
        idx = bucket(keys, salt + 10_000 + c, src.categories)
        cols[name] = names[idx]
        logits += cat_bias[c, idx, :]
    # Gumbel noise: argmax(logit + T * g) samples softmax(logit / T).
    gumbel = np.stack([-np.log(-np.log(uniform(keys, salt + 20_000 + j))) for j in range(k)], 1)
    cols[spec.label] = np.argmax(logits + src.noise * gumbel, axis=1).astype(np.int64)
    return pd.DataFrame(cols)


def part_urls(out: str, src: SyntheticSource) -> list[tuple[tuple[int, int], str]]:
    """(key range, file URL) of every raw file to generate under `out`."""
    return [(rng, storage.join(out, f"part-{i:05d}.parquet")) for i, rng in enumerate(key_ranges(src))]


def write_generated(rng: tuple[int, int], url: str, src: SyntheticSource, spec: FeatureSpec) -> int:
    """Generate keys rng[0]..rng[1]-1 into one Parquet file (in a task), through storage."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    start, stop = rng
    with storage.write(url) as f:
        writer = None
        for a in range(start, stop, 100_000):
            # Chunks keep a task's memory flat whatever the range's size.
            table = pa.Table.from_pandas(generate_rows(a, min(a + 100_000, stop), src, spec), preserve_index=False)
            writer = writer or pq.ParquetWriter(f, table.schema)
            writer.write_table(table)
        if writer:
            writer.close()
    return stop - start


def remove_stale_parts(out: str, written: list[str]) -> None:
    """Files of an earlier generate at `out` that this one did not rewrite (and what Spark's
    own writer left there before generating went through storage). Only such names."""
    keep = {storage.name(u) for u in written}
    for n in storage.list_dir(out):
        if n not in keep and (n.startswith(("part-", ".part-")) or n in ("_SUCCESS", "._SUCCESS.crc")):
            storage.delete(storage.join(out, n))
