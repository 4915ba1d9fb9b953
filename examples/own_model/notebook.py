"""The example as notebook cells: shardline's Python API on a SparkSession and on a Dask
client you already have, with the model and loss of the `mynets` package beside this file.

Run it from this folder (so `mynets` is importable, as it is for `shardline run job.toml`):

    cd examples/own_model && python notebook.py

Each function takes the engine and a work folder; in a notebook, call them with yours.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

import shardline

HERE = Path(__file__).resolve().parent
JOB = HERE / "job.toml"

# What the estimators train: the same model, loss and metric as job.toml.
MODEL = {
    "model": "mynets.nets:build",
    "model_args": {"width": 32, "depth": 2},
    "loss": "mynets.losses:smoothed_ce",
    "metrics": ["mynets.losses:top2"],
    "world_size": 2,
    "epochs": 2,
    "batch_size": 128,
    "lr": 0.01,
}


def _paths(workdir: Path, tracking_uri: str | None, name: str) -> dict:
    """job.toml's outputs moved under `workdir` (overrides, as `--set` takes them)."""
    return {
        "pipelines.source.path": str(workdir / "raw"),
        "pipelines.dataset_dir": str(workdir / "dataset"),
        "training.checkpoint_dir": str(workdir / "checkpoints"),
        "serving.output_dir": str(workdir / "scores"),
        "tracking.tracking_uri": tracking_uri or f"sqlite:///{workdir / 'mlflow.db'}",
        "tracking.registered_model": name,
    }


def frame(rows: int = 1500, seed: int = 0) -> pd.DataFrame:
    """A small in-memory table for the estimators: 3 classes from two numerics and a colour."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    color = rng.choice(["red", "green", "blue"], rows)
    score = x[:, 0] + x[:, 1] + np.where(color == "red", 1.0, 0.0)
    return pd.DataFrame({"x0": x[:, 0], "x1": x[:, 1], "color": color,
                         "label": np.digitize(score, [-0.5, 0.8]).astype(np.int64)})


def _estimator_config(workdir: Path, tracking_uri: str | None, name: str) -> dict:
    return {
        "pipelines": {"dataset_dir": str(workdir / "dataset"), "source": {"path": str(workdir / "raw")},
                      "layout": {"world_size": 2}},
        "training": {**MODEL, "checkpoint_dir": str(workdir / "checkpoints")},
        "tracking": {"tracking_uri": tracking_uri or f"sqlite:///{workdir / 'mlflow.db'}",
                     "registered_model": name},
    }


def on_spark(spark, workdir, tracking_uri: str | None = None, name: str = "own-model-spark") -> dict:
    """prepare, train, score with `spark`; then the Spark ML estimator on a DataFrame."""
    workdir = Path(workdir).resolve() / "spark"
    overrides = _paths(workdir / "job", tracking_uri, name)
    prepared = shardline.prepare(JOB, overrides, spark=spark)
    trained = shardline.train(JOB, overrides, spark=spark)
    scored = shardline.score(JOB, overrides, spark=spark, model_uri=trained.model_uri)

    from shardline.spark import ShardlineEstimator, ShardlineModel

    df = spark.createDataFrame(frame())
    model = ShardlineEstimator(_estimator_config(workdir / "estimator", tracking_uri, name + "-estimator"),
                               label_col="label").fit(df)
    # Saved as pyspark.ml saves a model (its registry URI and settings; the weights stay in
    # MLflow), loaded back, and used as the fitted one would be.
    model.write().overwrite().save(str(workdir / "estimator-model"))
    loaded = ShardlineModel.load(str(workdir / "estimator-model"))
    predictions = loaded.transform(df).toPandas()
    return {"prepared": prepared, "trained": trained, "scored": scored,
            "estimator_model_uri": loaded.model_uri, "predictions": predictions}


def on_dask(client, workdir, tracking_uri: str | None = None, name: str = "own-model-dask") -> dict:
    """The same with a Dask client: every stage on Dask (no setting names an engine, so the
    engine given decides), then the Dask estimator's fit/predict."""
    import dask.dataframe as dd

    workdir = Path(workdir).resolve() / "dask"
    overrides = _paths(workdir / "job", tracking_uri, name)
    prepared = shardline.prepare(JOB, overrides, client=client)
    trained = shardline.train(JOB, overrides, client=client)
    scored = shardline.score(JOB, overrides, client=client, model_uri=trained.model_uri)

    from shardline.dask import ShardlineEstimator

    pdf = frame(seed=1)
    ddf = dd.from_pandas(pdf, npartitions=2)
    # scikit-learn's way: features X and labels y (a Dask Series partitioned as X).
    X, y = ddf.drop(columns="label"), ddf["label"]
    est = ShardlineEstimator(_estimator_config(workdir / "estimator", tracking_uri, name + "-estimator"),
                             label_col="label", client=client).fit(X, y)
    predictions = pdf.assign(prediction=est.predict(X).compute())
    return {"prepared": prepared, "trained": trained, "scored": scored,
            "estimator_model_uri": est.model_uri, "predictions": predictions,
            "estimator_accuracy": est.score(X, y)}


def _summary(engine: str, out: dict) -> str:
    t, s, p = out["trained"], out["scored"], out["predictions"]
    accuracy = float((p["prediction"] == p["label"]).mean())
    return (f"{engine}: {t.model_uri} val_accuracy={t.metrics.get('val_accuracy', float('nan')):.3f} "
            f"val_top2={t.metrics.get('val_top2', float('nan')):.3f}; scored {s.rows} rows into {s.version_dir}; "
            f"estimator {out['estimator_model_uri']} accuracy on its table {accuracy:.3f}")


if __name__ == "__main__":
    import sys

    from shardline.foundation.engine_config import DaskConfig, SparkConfig
    from shardline.foundation.sessions import dask_client, spark_session

    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "example-out")
    spark = spark_session(SparkConfig(master="local[2]"))
    try:
        print(_summary("spark", on_spark(spark, workdir)))
    finally:
        spark.stop()
    client = dask_client(DaskConfig(n_workers=2))
    try:
        print(_summary("dask", on_dask(client, workdir)))
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()
