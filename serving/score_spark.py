"""Batch scoring on Spark: mapInArrow over the split's shards, one model per worker."""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipelines.errors import DataError
from pipelines.manifest import load_manifest

from .models import cached_model, resolve_version

OUTPUT_DDL = "key long, prediction long, probabilities array<float>, model_version string"


@dataclass
class ScoreResult:
    output_dir: str
    rows: int
    model_name: str
    model_version: str


def score_spark(
    spark,
    model_uri: str,
    tracking_uri: str,
    dataset_dir: str,
    split: str,
    output_dir: str,
    batch_size: int = 4096,
) -> ScoreResult:
    manifest = load_manifest(dataset_dir)
    shards = manifest.split(split).shards
    name, version = resolve_version(model_uri, tracking_uri)
    key = manifest.feature_spec.key

    files = [str(Path(dataset_dir).resolve() / s.path) for s in shards]
    df = spark.read.parquet(*files).select(key, "features")

    def score(batches):
        import numpy as np
        import pyarrow as pa
        import torch

        model = cached_model(model_uri, tracking_uri)
        device = next(model.parameters()).device
        for batch in batches:
            feats = batch.column(1)
            width = len(feats[0]) if len(feats) else 0
            x = np.array(feats.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
            x = torch.from_numpy(x.reshape(-1, width))
            probs = []
            with torch.inference_mode():
                for i in range(0, len(x), batch_size):
                    probs.append(torch.softmax(model(x[i : i + batch_size].to(device)), 1).cpu())
            p = torch.cat(probs).numpy() if probs else np.zeros((0, 0), np.float32)
            n, k = p.shape if p.size else (0, 0)
            yield pa.RecordBatch.from_arrays(
                [
                    batch.column(0).cast(pa.int64()),
                    pa.array(p.argmax(1) if n else [], pa.int64()),
                    pa.ListArray.from_arrays(
                        pa.array(np.arange(0, n * k + 1, k, dtype=np.int32) if n else [0]),
                        pa.array(p.reshape(-1), pa.float32()),
                    ),
                    pa.array([version] * n, pa.string()),
                ],
                names=["key", "prediction", "probabilities", "model_version"],
            )

    out = Path(output_dir).resolve()
    if out.exists() and not (out / "_SUCCESS").exists():
        raise DataError(f"{out}: output directory exists and holds no shardline scores")
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        df.mapInArrow(score, OUTPUT_DDL).write.parquet(str(tmp))
        rows = spark.read.parquet(str(tmp)).count()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ScoreResult(str(out), rows, name, version)
