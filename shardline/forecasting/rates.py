"""The model's rates on the sample dataset, per core: training steps (the planner's model,
optimizer and step on synthetic batches of the dataset's shape, compute only), one loader
worker draining rank 0's train shards, evaluation's forward pass, and scoring (the test
shards read, decoded, scored and written as serving's worker does, without the ledger).

Rates are samples per CPU second of this process (time.process_time, every thread), times
the threads a rank runs: a busy machine stretches wall time, not the work.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

BUDGET_S = 1.0  # each measure runs about this long (wall)


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

    from shardline.training.plan import training_device
    from shardline.training.strategies import strategy_for

    device = training_device()
    strategy = strategy_for(training)
    loader = _loader_rate(manifest, dataset_dir, training, strategy)
    train = _train_rate(manifest, training, device, strategy)
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


def _timed(step, least: int = 2) -> float:
    """CPU seconds per call of step() (after 2 warm-up calls): at least `least` calls, and
    until BUDGET_S of wall time has passed."""
    for _ in range(2):
        step()
    calls, wall, cpu = 0, time.perf_counter(), time.process_time()
    while calls < least or time.perf_counter() - wall < BUDGET_S:
        step()
        calls += 1
    return (time.process_time() - cpu) / calls


def _train_rate(manifest, training, device, strategy) -> float:
    """A rank's samples/s: training.plan's model, optimizer, batches and step, timed in CPU
    seconds over its threads_per_rank threads (one process, no all-reduce)."""
    import torch

    from shardline.training.plan import _synthetic_batch
    from shardline.training.batch import to_device
    from shardline.training.strategies.base import train_step
    from shardline.training.strategies.precision import Precision
    from shardline.training.task import loss_for
    from shardline.training.loop.recipe import make_optimizer, trainable_model

    local = training.batch_size // strategy.data_world
    threads = torch.get_num_threads()
    torch.set_num_threads(training.threads_per_rank)
    try:
        model = trainable_model(manifest, training, device)
        model.train()
        optimizer, autocast, loss_fn = make_optimizer(model.parameters(), training), \
            Precision.of(training).autocast(device), loss_for(training)
        batches = itertools.cycle([_synthetic_batch(manifest, local, seed) for seed in range(4)])

        def step():
            x, y = next(batches)
            train_step(model, optimizer, autocast, to_device(x, device), y.to(device), loss_fn)[1].item()

        return local * training.threads_per_rank / _timed(step)
    finally:
        torch.set_num_threads(threads)


def _loader_rate(manifest, dataset_dir: str, training, strategy) -> float:
    """Samples per CPU second of one loader worker draining rank 0's train shards, epoch
    after epoch (its reading thread and the buffer's work both counted); refused in one
    line, as the planner refuses, when an epoch is too short to time."""
    from shardline.training.batch import rows as batch_rows, split
    from shardline.training.plan import measured_loader

    loader = measured_loader(manifest, dataset_dir, training, strategy)
    samples, cpu, wall = 0, time.process_time(), time.perf_counter()
    for epoch in itertools.count():
        for batch in loader.epoch(epoch):
            samples += batch_rows(split(batch)[0])
        if time.perf_counter() - wall >= BUDGET_S:
            break
    return samples / max(1e-9, time.process_time() - cpu)


def _model(manifest, training):
    from shardline.training.models.builtin import build_model

    model = build_model(manifest, training)
    model.eval()
    return model


def _forward_rate(model, manifest, batch: int) -> float:
    import torch

    from shardline.training.plan import _synthetic_batch

    x, _ = _synthetic_batch(manifest, batch, 0)

    def forward():
        with torch.inference_mode():
            model(x)

    return batch / _timed(forward)


def _score_rate(model, manifest, dataset_dir: str, batch: int) -> tuple[float, float]:
    """Rows/s and output bytes per row of scoring the sample's test shards (train's if it
    has none): serving.worker's reading and decoding, the model, its output columns."""
    from shardline.foundation import storage
    from shardline.serving.inputs import Transform, Unit
    from shardline.serving.worker import UnitTask, _batches, output_schema
    from shardline.training.inference import predict

    split = manifest.splits.get("test")
    shards = (split.shards if split and split.shards else manifest.split("train").shards)
    spec = manifest.feature_spec
    classification = spec.task == "classification"
    schema = output_schema(classification, spec.task == "next_token")
    transform = Transform.of(manifest)
    rows = written = 0
    start, cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="shardline-forecast-scores-") as out:
        for i, shard in enumerate(shards):
            task = UnitTask(unit=Unit(storage.join(dataset_dir, shard.path), "shard", ""), output_dir=out,
                            output_name=f"{i}.parquet", model_uri="", tracking_uri="", model_name="m",
                            model_version="1", transform=transform, batch_size=batch)
            path = os.path.join(out, f"{i}.parquet")
            with pq.ParquetWriter(path, schema) as w:
                for keys, x in _batches(task, spec):
                    pred = predict(model, x, classification, transform.tensors)
                    w.write_batch(_output(keys, pred, schema, classification))
                    rows += len(keys)
            written += os.path.getsize(path)
            if time.perf_counter() - start > 4 * BUDGET_S:
                break
    return rows / max(1e-9, time.process_time() - cpu), written / max(1, rows)


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
