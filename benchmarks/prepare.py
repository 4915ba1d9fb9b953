"""`shardline bench prepare`: prepare MB/s on Spark and Dask vs a single-process pyarrow rewrite.

All three read the same raw Parquet files and write train/val/test shards with
the same split, statistics and transform; the baseline does it in one process
with pyarrow and numpy, no engine. MB/s = raw input bytes / wall seconds.
Engine start-up is excluded: both engines run a small prepare first; the raw data
is generated once.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.config import DaskConfig, PipelineConfig, SparkConfig
from pipelines.manifest import FittedStatistics, NumericStats
from pipelines.rows import split_of
from pipelines.transform import model_table


def pyarrow_rewrite(cfg: PipelineConfig, out: Path) -> int:
    """The baseline: read everything, split by key hash, fit on train, transform, write."""
    spec = cfg.features
    table = pq.read_table(cfg.source.path)
    splits = split_of(table.column(spec.key).to_numpy(), cfg.split)
    train = table.filter(pa.array(splits == "train"))
    numeric = {
        c: NumericStats(mean=float(pc.mean(train[c]).as_py()), std=float(pc.stddev(train[c]).as_py()))
        for c in spec.numeric
    }
    categorical = {}
    for c in spec.categorical:
        counts = pc.value_counts(train[c]).to_pylist()
        categorical[c] = [d["values"] for d in sorted(counts, key=lambda d: (-d["counts"], d["values"]))]
    stats = FittedStatistics(
        numeric=numeric,
        categorical=categorical,
        cardinality={c: len(v) for c, v in categorical.items()},
        num_classes=int(pc.max(table[spec.label]).as_py()) + 1,
    )
    out.mkdir(parents=True)
    for s in ("train", "val", "test"):
        part = table.filter(pa.array(splits == s)).sort_by(spec.key)
        pq.write_table(model_table(part, spec, stats, impute=False), out / f"{s}.parquet",
                       row_group_size=cfg.layout.rows_per_row_group)
    return table.num_rows


def run(rows: int, workdir: str | None = None, progress=print) -> dict:
    from pipelines.engine_dask import DaskEngine
    from pipelines.engine_spark import SparkEngine
    from pipelines.engines import dask_client, spark_session
    from pipelines.prepare import prepare

    root = Path(tempfile.mkdtemp(prefix="shardline-bench-", dir=workdir))
    try:
        cfg = PipelineConfig.model_validate(
            {
                "dataset_dir": str(root / "dataset"),
                "source": {"format": "parquet", "path": str(root / "raw"),
                           "synthetic": {"rows": rows, "partitions": 4}},
            }
        )
        client = dask_client(DaskConfig())
        dask = DaskEngine(client)
        progress(f"generating {rows:,} rows")
        dask.generate(cfg.model_copy(update={"source": cfg.source.model_copy(update={"format": "synthetic"})}))
        mb = sum(f.stat().st_size for f in (root / "raw").rglob("*.parquet")) / 1e6
        spark = SparkEngine(spark_session(SparkConfig()))

        # Warm-up: a small prepare on each engine first, so the first query's JVM and
        # worker start-up (5-9 s on Spark) is not charged to the measured run.
        warm = cfg.model_copy(
            update={
                "dataset_dir": str(root / "warm-dataset"),
                "source": cfg.source.model_copy(
                    update={"format": "synthetic", "path": str(root / "warm-raw"),
                            "synthetic": cfg.source.synthetic.model_copy(update={"rows": 20_000})}
                ),
            }
        )
        progress("warming up both engines")
        for engine in (spark, dask):
            prepare(engine, warm)

        timings = {}
        progress("pyarrow single-process rewrite")
        start = time.perf_counter()
        pyarrow_rewrite(cfg, root / "baseline")
        timings["pyarrow"] = time.perf_counter() - start
        for name, engine in (("spark", spark), ("dask", dask)):
            progress(f"prepare on {name}")
            start = time.perf_counter()
            prepare(engine, cfg)
            timings[name] = time.perf_counter() - start
        client.close()
        client.cluster.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    mbps = {k: mb / v for k, v in timings.items()}
    return {
        "benchmark": "prepare",
        "rows": rows,
        "input_mb": round(mb, 2),
        "seconds": {k: round(v, 3) for k, v in timings.items()},
        "mb_per_s": {k: round(v, 2) for k, v in mbps.items()},
        "ratio_vs_pyarrow": {k: round(mbps[k] / mbps["pyarrow"], 3) for k in ("spark", "dask")},
        "cores": _cores(),
    }


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)))
