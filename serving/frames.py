"""Predictions for a table of raw feature columns, in memory: the body of the estimators'
`transform` (Spark, in mapInArrow) and `predict` (Dask, per partition). The training
dataset's statistics transform the columns as prepare did (as batch scoring of raw input
does), and the model is the per-worker cached one."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from shardline.foundation.errors import ShardlineError

from shardline.pipelines.transform import features_matrix
from shardline.training.inference import predict

from .inputs import Transform
from .models import cached_model

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs); pandas (~0.7
# s: only where a DataFrame is built).


def feature_columns(transform: Transform) -> list[str]:
    spec = transform.spec
    return [*spec.numeric, *spec.categorical, *spec.vectors]


def predict_table(
    table: pa.Table, model_uri: str, tracking_uri: str, transform: Transform, threads: int = 1
) -> tuple[np.ndarray, np.ndarray | None]:
    """(predictions, class probabilities or None) for the rows of `table`: the class index
    (int64) for classification, the value (float64) for regression."""
    import torch  # a model runs here (an executor's task, a predict): torch is loaded with it

    spec = transform.spec
    classification = spec.task == "classification"
    missing = [c for c in feature_columns(transform) if c not in table.column_names]
    if missing:
        raise ShardlineError(f"column '{missing[0]}' is missing: the model {model_uri} was trained on it")
    impute = spec.on_invalid_features == "impute"
    if not impute:
        for c in spec.numeric:
            x = table.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
            bad = np.flatnonzero(~np.isfinite(x))
            if len(bad):
                raise ShardlineError(f"column '{c}' is null, NaN or inf in a row to score "
                                     "(pipelines.features.on_invalid_features = 'fail')")
    x = features_matrix(table, spec, transform.stats, impute)
    model = cached_model(model_uri, tracking_uri)
    torch.set_num_threads(threads)
    y = predict(model, x, classification)
    if classification:
        return y.argmax(1).astype(np.int64), y.astype(np.float32)
    return y[:, 0].astype(np.float64), None


def probabilities_array(probs: np.ndarray) -> pa.ListArray:
    n, k = probs.shape
    offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(probs.reshape(-1), pa.float32()))


def predict_partition(part, model_uri: str, tracking_uri: str, transform_json: tuple, proba: bool):
    """predict_table of a pandas partition (Dask's map_partitions): a Series `prediction`,
    or with `proba` a DataFrame of class probabilities (columns 0..K-1), on the partition's index."""
    import pandas as pd

    transform = Transform(*transform_json)
    pred = probs = None
    if len(part):
        table = pa.Table.from_pandas(part[feature_columns(transform)], preserve_index=False)
        pred, probs = predict_table(table, model_uri, tracking_uri, transform)
    if proba:
        k = transform.stats.num_classes
        data = probs if probs is not None else np.zeros((0, k), np.float32)
        return pd.DataFrame(data, index=part.index, columns=list(range(k)), dtype="float32")
    dtype = "int64" if transform.spec.task == "classification" else "float64"
    return pd.Series(pred if pred is not None else [], index=part.index, name="prediction", dtype=dtype)
