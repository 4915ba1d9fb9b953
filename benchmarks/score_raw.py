"""`shardline bench score`, raw rows: scoring the dataset's raw Parquet files through the
model's transform (the one the registered pyfunc embeds, training.models.registered), so the
read -> parse -> transform -> infer -> write path is measured, not only inference on
prepared features.

- spark_raw, dask_raw: `serving.score.score` on the raw files (the whole job).
- processes_raw: the same read-transform-infer-write loop (`raw_loop`, the functions
  batch scoring and the pyfunc call) in one plain process per core, no engine: the
  figure the engines are held to (target: >= 0.95 x).
- predict_batch_udf_raw: `pyspark.ml.functions.predict_batch_udf` over the raw columns
  with the same transform inside its predict function (target: engines >= 1.5 x).

Every method scores every row of every raw file (all splits), once unmeasured, then
measured `rounds` times, as the prepared figures do.
"""

from __future__ import annotations

import inspect
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.benchmarks.score import measure_rounds, plain_processes, score_measure, scores_batch, udf_measure
from shardline.benchmarks.score_udf import probabilities_udf, write_udf_scores
from shardline.pipelines.config import FeatureSpec
from shardline.pipelines.manifest import FittedStatistics
from shardline.pipelines.transform import features_matrix
from shardline.serving.worker import output_schema
from shardline.training.models.registered import load_torch_model

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs); MLflow (~2.5
# s: only where MLflow is called); pyspark (only with a Spark session: Dask and local jobs never import it).

BATCH_SIZE = 4096  # serving.score's default, as for the prepared figures


def raw_files(manifest) -> list[str]:
    """The dataset's raw Parquet files (its manifest's sources)."""
    files = [str(s["path"]) for s in manifest.sources if s["format"] in ("parquet", "synthetic")]
    if not files or len(files) != len(manifest.sources):
        raise RuntimeError("bench score: the dataset's sources are not all Parquet files")
    return files


def raw_loop(model, paths: list[str], out: Path, spec_json: str, stats_json: str, model_name: str,
             model_version: str) -> int:
    """Raw files -> features (the training transform) -> probabilities -> Parquet, in this
    process; `model` is loaded. Returns rows scored."""
    import torch

    spec = FeatureSpec.model_validate_json(spec_json)
    stats = FittedStatistics.model_validate_json(stats_json)
    impute = spec.on_invalid_features == "impute"
    columns = [spec.key, *spec.numeric, *spec.categorical, *spec.vectors]
    schema = output_schema(classification=True)
    out.mkdir(parents=True)
    rows = 0
    scored_at = datetime.now(timezone.utc)
    for i, path in enumerate(paths):
        with pq.ParquetWriter(out / f"part-{i:05d}.parquet", schema) as writer:
            for batch in pq.ParquetFile(path).iter_batches(BATCH_SIZE, columns=columns, use_threads=False):
                x = features_matrix(pa.Table.from_batches([batch]), spec, stats, impute)
                with torch.inference_mode():
                    p = torch.softmax(model(torch.from_numpy(x)), 1).numpy()
                writer.write_batch(scores_batch(batch.column(0).cast(pa.int64()), p, schema, model_name,
                                                model_version, scored_at))
                rows += len(p)
    return rows


def _raw_process(barrier, results, model_uri, tracking_uri, paths, out, spec_json, stats_json, name, version):
    import mlflow
    import torch

    torch.set_num_threads(1)
    mlflow.set_tracking_uri(tracking_uri)
    model = load_torch_model(model_uri).eval()
    barrier.wait()  # every process loaded: the clock starts now
    results.put(raw_loop(model, paths, out, spec_json, stats_json, name, version) if paths else 0)


def raw_processes(cores: int, model_uri: str, tracking_uri: str, paths: list[str], out: Path,
                  spec_json: str, stats_json: str, name: str, version: str) -> tuple[int, float]:
    """`raw_loop` in `cores` plain processes at once, the files dealt round-robin:
    (rows, seconds from the common start)."""
    return plain_processes(_raw_process, [
        (model_uri, tracking_uri, paths[i::cores], out / f"p{i}", spec_json, stats_json, name, version)
        for i in range(cores)
    ])


def predict_batch_udf_raw_job(spark, model_uri: str, tracking_uri: str, spec_json: str, stats_json: str):
    """predict_batch_udf over the raw columns, the training transform in its predict
    function; a function scoring raw files into a directory (one udf: its per-worker
    model cache survives from the warm-up to the measured run)."""
    from pyspark.sql import functions as F

    spec = FeatureSpec.model_validate_json(spec_json)
    columns = [*spec.numeric, *spec.categorical, *spec.vectors]

    def make_predict_fn():
        import mlflow
        import torch

        from shardline.pipelines.manifest import FittedStatistics
        from shardline.pipelines.transform import features_matrix

        stats = FittedStatistics.model_validate_json(stats_json)
        impute = spec.on_invalid_features == "impute"
        mlflow.set_tracking_uri(tracking_uri)
        model = load_torch_model(model_uri).eval()

        def predict(*arrays: np.ndarray) -> dict:
            data = {}
            for c, a in zip(columns, arrays):
                if c in spec.vectors:
                    data[c] = pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), spec.vectors[c])
                else:
                    data[c] = pa.array(a, from_pandas=True)
            x = features_matrix(pa.table(data), spec, stats, impute)
            with torch.inference_mode():
                p = torch.softmax(model(torch.from_numpy(x)), 1).numpy()
            return {"prediction": p.argmax(1).astype(np.int64), "probabilities": p}

        # predict_batch_udf counts the function's parameters to decide how to pass the
        # columns: one per raw column.
        predict.__signature__ = inspect.Signature(
            [inspect.Parameter(f"c{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(len(columns))]
        )
        return predict

    udf = probabilities_udf(make_predict_fn, [[spec.vectors[c]] if c in spec.vectors else None for c in columns])

    def run(paths: list[str], out: Path, model_name: str, model_version: str) -> None:
        frame = spark.read.parquet(*paths)
        write_udf_scores(frame.select(F.col(spec.key).cast("long").alias("key"), udf(*columns).alias("p")),
                         out, model_name, model_version)

    return run


def measure(spark, client, model, tracking_uri: str, manifest, root: Path, cores: int, rounds: int,
            progress) -> tuple[dict[str, float], dict[str, int], dict[str, list[float]], int]:
    """(median seconds per method, rows each scored, every run's seconds, rows of the raw
    files); every method `rounds` times (benchmarks.score.measure_rounds)."""
    files = raw_files(manifest)
    n = sum(pq.read_metadata(f).num_rows for f in files)
    spec_json = manifest.feature_spec.model_dump_json()
    stats_json = manifest.statistics.model_dump_json()
    # The raw files as one input (a directory of links: the batch job takes a file,
    # a directory or a glob, and the sources may sit beside other files).
    raw = root / "raw-input"
    raw.mkdir()
    for i, f in enumerate(files):
        (raw / f"part-{i:05d}.parquet").symlink_to(Path(f).resolve())

    jobs = {f"{name}_raw": score_measure(name, handle, model.pinned_uri, tracking_uri, str(raw))
            for name, handle in (("spark", spark), ("dask", client))}
    for name, measure in jobs.items():
        progress(f"{name}: score the raw files once unmeasured (the warm-up)")
        measure(root / f"warm-{name}")
    progress("predict_batch_udf on raw columns, the transform inside: once unmeasured (the warm-up)")
    pbu = udf_measure(predict_batch_udf_raw_job(spark, model.pinned_uri, tracking_uri, spec_json, stats_json),
                      files, model.name, model.version)
    pbu(root / "warm-pbu-raw")

    seconds, scored, runs = measure_rounds({
        **jobs,
        "predict_batch_udf_raw": pbu,
        # the read-transform-infer-write loop in one plain process per core, all at once
        "processes_raw": lambda out: raw_processes(cores, model.pinned_uri, tracking_uri, files, out, spec_json,
                                                   stats_json, model.name, model.version),
    }, root / "runs-raw", rounds, progress)
    return seconds, scored, runs, n
