"""The image example as notebook cells: generated PNGs in class folders, prepared on Spark
and on Dask (the same shards, byte for byte), the example's own CNN trained with FSDP,
registered in MLflow, and the test split scored.

Run it from this folder (so `imgnets` is importable, as it is for `shardline run job.toml`):

    cd examples/images && python notebook.py

`run` takes the engines and a work folder; in a notebook, call it with yours.
"""

from __future__ import annotations

from pathlib import Path

import shardline

HERE = Path(__file__).resolve().parent
JOB = HERE / "job.toml"


def _make_images():
    """make_images.py beside this file, wherever the caller's working folder is."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_images", HERE / "make_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shard_digests(prepared) -> dict[str, list[str]]:
    """Each split's shard files by their sha256 (the manifest records them)."""
    return {name: [s.sha256 for s in split.shards] for name, split in prepared.manifest.splits.items()}


def run(spark, client, workdir, tracking_uri: str | None = None, name: str = "images-example",
        per_class: int = 64, epochs: int = 4) -> dict:
    """Prepare on both engines, train on Dask ranks (fsdp), score on Spark."""
    workdir = Path(workdir).resolve()
    images = _make_images().write_images(workdir / "images", per_class=per_class)
    common = {
        "pipelines.source.path": str(images),
        "training.checkpoint_dir": str(workdir / "checkpoints"),
        "training.epochs": epochs,
        "serving.output_dir": str(workdir / "scores"),
        "tracking.tracking_uri": tracking_uri or f"sqlite:///{workdir / 'mlflow.db'}",
        "tracking.registered_model": name,
    }
    on_spark = {**common, "pipelines.dataset_dir": str(workdir / "dataset-spark")}
    on_dask = {**common, "pipelines.dataset_dir": str(workdir / "dataset-dask")}
    prepared = {"spark": shardline.prepare(JOB, on_spark, spark=spark),
                "dask": shardline.prepare(JOB, on_dask, client=client)}
    trained = shardline.train(JOB, on_dask, client=client)
    scored = shardline.score(JOB, on_dask, spark=spark, model_uri=trained.model_uri)
    return {"prepared": prepared, "trained": trained, "scored": scored,
            "same_shards": shard_digests(prepared["spark"]) == shard_digests(prepared["dask"])}


if __name__ == "__main__":
    from shardline.foundation.engine_config import DaskConfig, SparkConfig
    from shardline.foundation.sessions import dask_client, spark_session

    spark = spark_session(SparkConfig(master="local[2]"))
    client = dask_client(DaskConfig(n_workers=2))
    try:
        out = run(spark, client, HERE / "example-out" / "notebook")
    finally:
        spark.stop()
        cluster = client.cluster
        client.close()
        cluster.close()
    t, s = out["trained"], out["scored"]
    print(f"Spark and Dask wrote the same shards: {out['same_shards']}")
    print(f"{t.model_uri} (fsdp on {t.launcher}): val_accuracy={t.metrics.get('val_accuracy', float('nan')):.3f}; "
          f"scored {s.rows} rows on {s.engine} into {s.version_dir}")
