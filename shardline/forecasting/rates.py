"""The model's rates on the sample dataset, one thread each: training steps (the planner's
measure, compute only), the loader (one worker, the planner's measure), evaluation's
forward pass, and scoring (the test shards read, decoded, scored and written as
serving's worker does, without the ledger)."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

BUDGET_S = 1.0  # each measure runs about this long


class ModelRates(BaseModel):
    train_samples_per_s: float  # per rank, threads_per_rank threads, compute only
    loader_samples_per_s: float  # one loader worker
    forward_samples_per_s: float  # evaluation: forward only, no gradient
    score_rows_per_s: float  # one scoring task: read, forward, write
    parameters: int
    score_bytes_per_row: float  # scores written
    row_bytes: float  # a shard row in memory (features + label)
    device: str


def measure_model(manifest, dataset_dir: str, training, serving) -> ModelRates:
    import torch

    from shardline.training.plan import measure_loader, measure_training, training_device
    from shardline.training.strategies import strategy_for

    device = training_device()
    strategy = strategy_for(training)
    loader = measure_loader(manifest, dataset_dir, training, budget_s=BUDGET_S, strategy=strategy)
    train = measure_training(manifest, training, device, budget_s=BUDGET_S, strategy=strategy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a scoring task's torch runs one thread (serving.worker)
    try:
        model = _model(manifest, training)
        forward = _forward_rate(model, manifest, serving.batch_size)
        if manifest.feature_spec.task == "next_token":  # its scores are a loss per row: a forward pass
            score_rate, score_bytes = forward, 24.0
        else:
            score_rate, score_bytes = _score_rate(model, manifest, dataset_dir, serving.batch_size)
    finally:
        torch.set_num_threads(threads)
    width = manifest.tensors["features"].shape[0] if "features" in manifest.tensors else 0
    return ModelRates(
        train_samples_per_s=train, loader_samples_per_s=loader, forward_samples_per_s=forward,
        score_rows_per_s=score_rate, parameters=sum(p.numel() for p in model.parameters()),
        score_bytes_per_row=score_bytes, row_bytes=4 * width + 16, device=str(device),
    )


def _model(manifest, training):
    from shardline.training.models.builtin import build_model

    model = build_model(manifest, training)
    model.eval()
    return model


def _forward_rate(model, manifest, batch: int) -> float:
    import torch

    from shardline.training.plan import _synthetic_batch

    x, _ = _synthetic_batch(manifest, batch, 0)
    rows, start = 0, time.perf_counter()
    with torch.inference_mode():
        while rows < 2 * batch or time.perf_counter() - start < BUDGET_S:
            model(x)
            rows += batch
    return rows / (time.perf_counter() - start)


def _score_rate(model, manifest, dataset_dir: str, batch: int) -> tuple[float, float]:
    """Rows/s and output bytes per row of scoring the sample's test shards (train's if it
    has none): serving.worker's reading and decoding, the model, its output columns."""
    from shardline.foundation import storage
    from shardline.serving.inputs import Transform, Unit
    from shardline.serving.worker import UnitTask, _batches, _predict, output_schema

    split = manifest.splits.get("test")
    shards = (split.shards if split and split.shards else manifest.split("train").shards)
    spec = manifest.feature_spec
    classification = spec.task == "classification"
    schema = output_schema(classification, spec.task == "next_token")
    transform = Transform.of(manifest)
    rows = written = 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardline-forecast-scores-") as out:
        for i, shard in enumerate(shards):
            task = UnitTask(unit=Unit(storage.join(dataset_dir, shard.path), "shard", ""), output_dir=out,
                            output_name=f"{i}.parquet", model_uri="", tracking_uri="", model_name="m",
                            model_version="1", transform=transform, batch_size=batch)
            path = os.path.join(out, f"{i}.parquet")
            with pq.ParquetWriter(path, schema) as w:
                for keys, x in _batches(task, spec):
                    pred = _predict(model, x, classification, transform.tensors)
                    w.write_batch(_output(keys, pred, schema, classification))
                    rows += len(keys)
            written += os.path.getsize(path)
            if time.perf_counter() - start > 4 * BUDGET_S:
                break
    seconds = time.perf_counter() - start
    return rows / seconds, written / max(1, rows)


def _output(keys, pred: np.ndarray, schema: pa.Schema, classification: bool) -> pa.RecordBatch:
    """serving.worker's output columns of one batch (key, prediction, probabilities, model)."""
    import datetime as dt

    n = len(keys)
    cols = [keys]
    if classification:
        k = pred.shape[1]
        offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
        cols += [pa.array(pred.argmax(1), pa.int64()),
                 pa.ListArray.from_arrays(offsets, pa.array(pred.reshape(-1), pa.float32()))]
    else:
        cols.append(pa.array(pred[:, 0].astype(np.float64)))
    now = dt.datetime.now(dt.timezone.utc)
    cols += [pa.array(["m"] * n, pa.string()), pa.array(["1"] * n, pa.string()),
             pa.array([now] * n, pa.timestamp("us", tz="UTC"))]
    return pa.RecordBatch.from_arrays(cols, schema=schema)
