"""The feature transform, fitted statistics in, model tensors out. Pure numpy/pyarrow.

Prepare applies it to parsed rows on either engine, and serving applies it to raw
input with the training dataset's statistics: one implementation, so training
and serving cannot skew.
"""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa

from .config import FeatureSpec
from .manifest import FittedStatistics

# Imported inside the functions that use them: pipelines.rows (imports pandas).


def feature_width(spec: FeatureSpec) -> int:
    return len(spec.numeric) + sum(spec.vectors.values()) + len(spec.categorical)


def continuous_width(spec: FeatureSpec) -> int:
    """Leading float features; the categorical indices follow them."""
    return len(spec.numeric) + sum(spec.vectors.values())


def hash_category(value: str, buckets: int) -> int:
    return zlib.crc32(value.encode()) % buckets + 1


def features(
    numeric: dict[str, np.ndarray],
    categorical: dict[str, tuple[np.ndarray, list[str]]],
    vectors: dict[str, np.ndarray],
    n: int,
    spec: FeatureSpec,
    stats: FittedStatistics,
    impute: bool,
) -> np.ndarray:
    """float32 [rows, feature_width]: standardised numerics, vectors, category indices.

    Inputs as rows.parse gives them: float64 columns (NaN where null), categorical
    dictionary codes (-1 where null) with their values, float64 [rows, length] vectors.
    """
    out = np.zeros((n, feature_width(spec)), dtype=np.float32)
    j = 0
    for c in spec.numeric:
        st = stats.numeric[c]
        z = (numeric[c] - st.mean) / st.std
        if impute:
            z[~np.isfinite(z)] = 0.0  # the train mean, standardised
        out[:, j] = z
        j += 1
    for c, length in spec.vectors.items():
        v = vectors[c]
        if impute:
            v = np.where(np.isfinite(v), v, 0.0)
        out[:, j : j + length] = v
        j += length
    for c in spec.categorical:
        codes, values = categorical[c]
        if spec.categorical_encoding == "hash":
            lut = [hash_category(v, spec.hash_buckets) for v in values]
        else:
            index = {v: i + 1 for i, v in enumerate(stats.categorical[c])}
            lut = [index.get(v, 0) for v in values]
        lut = np.array([*lut, 0], dtype=np.float32)  # the last entry: null -> 0, unknown
        out[:, j] = lut[np.where(codes >= 0, codes, len(values))]
        j += 1
    return out


def features_matrix(
    table: pa.Table, spec: FeatureSpec, stats: FittedStatistics, impute: bool
) -> np.ndarray:
    """features() of a table of raw feature columns, parsed as prepare parses them."""
    from .rows import parse_features

    numeric, categorical, vectors, _ = parse_features(table, spec)
    return features(numeric, categorical, vectors, table.num_rows, spec, stats, impute)


def features_column(feats: np.ndarray) -> pa.ListArray:
    """[rows, width] float32 as the list<float32> column shards hold."""
    n, width = feats.shape
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(feats).reshape(-1)))
