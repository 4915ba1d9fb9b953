"""`bench score`'s predict_batch_udf baseline (benchmarks.score, benchmarks.score_raw): Spark's
own batch inference, `pyspark.ml.functions.predict_batch_udf`, over the same files on the same
session, its model's torch module loaded as batch scoring loads it, written as Parquet with the
batch job's columns, in batches of the batch job's size.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from shardline.training.models.registered import load_torch_model

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs); MLflow (~2.5
# s: only where MLflow is called); pyspark (only with a Spark session: Dask and local jobs never import it);
# benchmarks.score (a cycle: it imports this module).


def predict_batch_udf_job(spark, model_uri: str, tracking_uri: str, width: int):
    """(the udf, a function that scores shard files into a directory); one udf, so its
    per-worker model cache survives from the warm-up to the measured run."""
    from pyspark.sql import functions as F

    def make_predict_fn():
        import mlflow
        import torch

        mlflow.set_tracking_uri(tracking_uri)
        model = load_torch_model(model_uri).eval()

        def predict(x: np.ndarray) -> dict:
            with torch.inference_mode():
                p = torch.softmax(model(torch.from_numpy(x.astype(np.float32, copy=False))), 1).numpy()
            return {"prediction": p.argmax(1).astype(np.int64), "probabilities": p}

        return predict

    udf = probabilities_udf(make_predict_fn, [[width]])

    def run(paths: list[str], out: Path, model_name: str, model_version: str) -> None:
        frame = spark.read.parquet(*paths)
        write_udf_scores(frame.select(F.col("key").cast("long").alias("key"), udf("features").alias("p")),
                         out, model_name, model_version)

    return run


def probabilities_udf(make_predict_fn, input_tensor_shapes: list):
    """predict_batch_udf returning the struct (prediction, probabilities), in batches of BATCH_SIZE."""
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.types import ArrayType, FloatType, LongType, StructField, StructType

    from shardline.benchmarks.score import BATCH_SIZE

    return predict_batch_udf(
        make_predict_fn,
        return_type=StructType([
            StructField("prediction", LongType()),
            StructField("probabilities", ArrayType(FloatType())),
        ]),
        batch_size=BATCH_SIZE,
        input_tensor_shapes=input_tensor_shapes,
    )


def write_udf_scores(frame, out: Path, model_name: str, model_version: str) -> None:
    """`frame` (key, the udf's struct p) as Parquet with the batch job's columns."""
    from pyspark.sql import functions as F

    p = F.col("p")
    frame.select(
        "key",
        p["prediction"].alias("prediction"),
        p["probabilities"].alias("probabilities"),
        F.lit(model_name).alias("model_name"),
        F.lit(model_version).alias("model_version"),
        F.lit(datetime.now(timezone.utc)).alias("scored_at"),
    ).write.mode("overwrite").parquet(str(out))
