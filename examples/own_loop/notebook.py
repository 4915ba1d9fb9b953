"""The own-loop examples as notebook cells: your own training loops (a GAN, a two-tower
model) trained by shardline on the launcher you choose, registered, and scored.

Run it from this folder (so `ownloops` is importable, as it is for the CLI):

    cd examples/own_loop && python notebook.py

Each function takes the engine you already have (a SparkSession, a Dask client, or none for
the local launcher) and a work folder; in a notebook, call them with yours.
"""

from __future__ import annotations

from pathlib import Path

import shardline

HERE = Path(__file__).resolve().parent
JOBS = {"gan": HERE / "gan.toml", "towers": HERE / "towers.toml"}
# What each example's data is made of, and the small sizes a quick try (or a test) uses.
SMALL = {"gan": {"per_class": 12}, "towers": {"rows": 600}}
SMALL_TRAINING = {
    "gan": {"training.batch_size": 32, "training.loop_args.epochs": 4, "training.loop_args.save_every": 2,
            "training.loop_args.width": 32},
    "towers": {"training.batch_size": 64, "training.loop_args.epochs": 2, "training.loop_args.save_every": 2},
}


def _make_data():
    """make_data.py beside this file, wherever the caller's working folder is."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_data", HERE / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_data(example: str, workdir, **size) -> Path:
    """The example's raw data under `workdir`: digit PNGs (gan) or interaction rows (towers)."""
    data, workdir = _make_data(), Path(workdir).resolve()
    if example == "gan":
        return data.write_digits(workdir / "digits", **size)
    return data.write_interactions(workdir / "interactions.parquet", **size)


def overrides(example: str, workdir, tracking_uri: str | None = None, name: str | None = None,
              sets: dict | None = None) -> dict:
    """The job's paths under `workdir`, its MLflow store and registered model's name (as
    `--set` takes them), and any other settings (`sets`: {"training.loop_args.epochs": 2})."""
    workdir = Path(workdir).resolve()
    source = workdir / ("digits" if example == "gan" else "interactions.parquet")
    return {
        "pipelines.source.path": str(source),
        "pipelines.dataset_dir": str(workdir / f"{example}-dataset"),
        "training.checkpoint_dir": str(workdir / f"{example}-checkpoints"),
        "serving.output_dir": str(workdir / f"{example}-scores"),
        "tracking.tracking_uri": tracking_uri or f"sqlite:///{workdir / 'mlflow.db'}",
        **({"tracking.registered_model": name} if name else {}),
        **(sets or {}),
    }


def prepare(example: str, workdir, spark=None, client=None, small: bool = False, **how):
    """The raw data made and prepared into shards (on the engine given; none: Spark). `how`:
    overrides' tracking_uri, name, sets."""
    make_data(example, workdir, **(SMALL[example] if small else {}))
    return shardline.prepare(JOBS[example], overrides(example, workdir, **how), spark=spark, client=client)


def train(example: str, workdir, spark=None, client=None, small: bool = False, sets: dict | None = None, **how):
    """The example's loop on the engine given (a SparkSession: a barrier stage; a Dask client:
    its workers; neither: `training.launcher`, local processes unless set): its TrainResult."""
    sets = {**(SMALL_TRAINING[example] if small else {}), **(sets or {})}
    if spark is None and client is None:
        sets.setdefault("training.launcher", "local")
    return shardline.train(JOBS[example], overrides(example, workdir, sets=sets, **how), spark=spark, client=client)


def generate(workdir, model_uri: str, spark=None, client=None, rows: int = 20, **how):
    """The registered generator scored on a table of latent vectors (key, z, digit): each row's
    image is the list column `output` (256 values in [-1, 1], a [1, 16, 16] image)."""
    latents = _make_data().write_latents(Path(workdir).resolve() / "latents.parquet", rows=rows)
    return shardline.score(JOBS["gan"], overrides("gan", workdir, **how), spark=spark, client=client,
                           model_uri=model_uri, input_path=str(latents))


def embed(workdir, model_uri: str, spark=None, client=None, **how):
    """The registered item tower scored on the dataset's test split: each key's embedding (`output`)."""
    return shardline.score(JOBS["towers"], overrides("towers", workdir, **how), spark=spark, client=client,
                           model_uri=model_uri)


def save_pngs(scores_dir, folder) -> list[Path]:
    """The generated images of a scoring run's output as PNG files, one a key."""
    import numpy as np
    import pyarrow.parquet as pq
    from PIL import Image

    table = pq.read_table(scores_dir).sort_by("key")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for key, values in zip(table.column("key").to_pylist(), table.column("output").to_pylist()):
        pixels = ((np.asarray(values, dtype=np.float32).reshape(16, 16) + 1) * 127.5).clip(0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{key:04d}.png")
        written.append(folder / f"{key:04d}.png")
    return written


if __name__ == "__main__":
    import sys

    from shardline.foundation.engine_config import DaskConfig, SparkConfig
    from shardline.foundation.sessions import dask_client, spark_session

    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "example-out").resolve() / "notebook"
    spark = spark_session(SparkConfig(master="local[2]"))
    client = dask_client(DaskConfig(n_workers=2))
    try:
        prepare("gan", workdir, spark=spark)
        gan = train("gan", workdir, spark=spark)  # the GAN on Spark's ranks
        scored = generate(workdir, gan.model_uri, spark=spark)
        pngs = save_pngs(scored.version_dir, workdir / "generated")
        print(f"{gan.model_uri}: loss_d={gan.metrics['loss_d']:.3f} loss_g={gan.metrics['loss_g']:.3f}; "
              f"{len(pngs)} generated digits in {pngs[0].parent}")
        prepare("towers", workdir, client=client)
        towers = train("towers", workdir, client=client)  # the two towers on Dask's workers
        embedded = embed(workdir, towers.model_uri, client=client)
        print(f"{towers.model_uri}: loss={towers.metrics['loss']:.3f}; {embedded.rows} item embeddings "
              f"in {embedded.version_dir}")
    finally:
        spark.stop()
        cluster = client.cluster
        client.close()
        cluster.close()
