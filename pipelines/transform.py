"""The feature transform, fitted statistics in, model tensors out. Pure numpy/pyarrow.

The shard writer applies it on either engine, and serving applies it to raw
input with the training dataset's statistics: one implementation, so training
and serving cannot skew.
"""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import FeatureSpec
from .manifest import FittedStatistics


def feature_width(spec: FeatureSpec) -> int:
    return len(spec.numeric) + sum(spec.vectors.values()) + len(spec.categorical)


def continuous_width(spec: FeatureSpec) -> int:
    """Leading float features; the categorical indices follow them."""
    return len(spec.numeric) + sum(spec.vectors.values())


def hash_category(value: str, buckets: int) -> int:
    return zlib.crc32(value.encode()) % buckets + 1


def features_matrix(
    table: pa.Table, spec: FeatureSpec, stats: FittedStatistics, impute: bool
) -> np.ndarray:
    """float32 [rows, feature_width]: standardised numerics, vectors, category indices."""
    n = table.num_rows
    out = np.zeros((n, feature_width(spec)), dtype=np.float32)
    j = 0
    for c in spec.numeric:
        x = table.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
        st = stats.numeric[c]
        z = (x - st.mean) / st.std
        if impute:
            z[~np.isfinite(z)] = 0.0  # the train mean, standardised
        out[:, j] = z
        j += 1
    for c, length in spec.vectors.items():
        col = table.column(c).combine_chunks()
        v = col.flatten().to_numpy(zero_copy_only=False).reshape(n, length)
        if impute:
            v = np.where(np.isfinite(v), v, 0.0)
        out[:, j : j + length] = v
        j += length
    for c in spec.categorical:
        col = table.column(c)
        if spec.categorical_encoding == "hash":
            enc = col.combine_chunks().cast(pa.string()).dictionary_encode()
            values = enc.dictionary.to_pylist()
            codes = np.array([hash_category(v, spec.hash_buckets) for v in values] + [0])
            idx = codes[pc.fill_null(enc.indices, len(values)).to_numpy(zero_copy_only=False)]
        else:
            vocab = pa.array(stats.categorical[c], pa.string())
            pos = pc.index_in(col.cast(pa.string()), value_set=vocab)
            idx = pc.fill_null(pc.add(pos, 1), 0).to_numpy(zero_copy_only=False)
        out[:, j] = idx
        j += 1
    return out


def model_table(table: pa.Table, spec: FeatureSpec, stats: FittedStatistics, impute: bool) -> pa.Table:
    """key, features (list<float32>), label: what shards hold and trainers read."""
    feats = features_matrix(table, spec, stats, impute)
    width = feats.shape[1]
    offsets = pa.array(np.arange(0, (table.num_rows + 1) * width, width, dtype=np.int32))
    label_type = pa.int64() if spec.task == "classification" else pa.float32()
    return pa.table(
        {
            spec.key: table.column(spec.key).cast(pa.int64()),
            "features": pa.ListArray.from_arrays(offsets, pa.array(feats.reshape(-1))),
            spec.label: table.column(spec.label).cast(label_type),
        }
    )
