"""`shardline bench prepare`: prepare MB/s on Spark and Dask vs the same work written natively.

On the same raw Parquet files, in the same run: shardline's prepare on Spark and on
Dask, a native Spark SQL job and a native dask.dataframe job doing the same work
(benchmarks/prepare_native.py), and a single-process pyarrow rewrite. MB/s = raw
input bytes / wall seconds. Engine start-up is excluded: every job runs once on a
small input first. With `rounds` > 1 the jobs run that many times, interleaved
(native, shardline, native, ...), and each keeps its best time, so a burst of
load on a shared machine does not decide a ratio.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from shardline.engines import DaskEngine, SparkEngine
from shardline.foundation.engine_config import DaskConfig, SparkConfig
from shardline.foundation.sessions import dask_client as make_dask_client, spark_session
from shardline.pipelines.config import PipelineConfig
from shardline.pipelines.prepare import prepare
from shardline.pipelines.synthetic import generate

from .prepare_native import native_dask, native_pyarrow, native_spark

JOBS = ("pyarrow", "spark_native", "spark", "dask_native", "dask")
WARM_ROWS = 20_000  # the warm-up's input, or the measured one if that is smaller


def bench_config(root: Path, rows: int, partitions: int = 4) -> PipelineConfig:
    """The prepare every job does: synthetic raw Parquet at root/raw, the quickstart's columns."""
    return PipelineConfig.model_validate(
        {
            "dataset_dir": str(root / "dataset"),
            "source": {"format": "synthetic", "path": str(root / "raw"),
                       "synthetic": {"rows": rows, "partitions": partitions}},
            "features": {"key": "key", "label": "label",
                         "numeric": [f"x{i}" for i in range(8)], "categorical": ["color"]},
        }
    )


def run(rows: int, rounds: int = 1, workdir: str | None = None, progress=print, *, dask_client=None) -> dict:
    """Given a running Dask client (`dask_client`: the tests pass the session's), it measures
    on that instead of starting a local cluster of its own: the same figures, less set-up.
    Spark: the active session if there is one (spark_session), else a new one."""
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-", dir=workdir))
    own_client = None
    try:
        client = dask_client
        if client is None:
            client = own_client = make_dask_client(DaskConfig())
        dask = DaskEngine(client)
        spark_session_ = spark_session(SparkConfig())
        spark = SparkEngine(spark_session_)
        cfg = bench_config(root, rows)
        progress(f"generating {rows:,} rows")
        generate(dask, cfg.source.synthetic, cfg.source.path)
        raw = cfg.source.path
        mb = sum(f.stat().st_size for f in Path(raw).glob("*.parquet")) / 1e6
        parquet = cfg.model_copy(update={"source": cfg.source.model_copy(update={"format": "parquet"})})

        def job(name: str, out: Path, c: PipelineConfig):
            source = c.source.path
            return {
                "pyarrow": lambda: native_pyarrow(source, out, c),
                "spark_native": lambda: native_spark(spark_session_, source, str(out), c),
                "dask_native": lambda: native_dask_on(client, source, str(out), c),
                "spark": lambda: prepare(spark, c.model_copy(update={"dataset_dir": str(out)})),
                "dask": lambda: prepare(dask, c.model_copy(update={"dataset_dir": str(out)})),
            }[name]

        # Warm-up: the first query's JVM and worker start-up (5-9 s on Spark) is not
        # charged to the measured runs. Never more rows than the measured runs have: a
        # tiny run's warm-up would otherwise be most of its time.
        progress("warming up both engines")
        warm = _warm_input(dask, root, rows, parquet)
        for name in JOBS:
            job(name, root / "warm" / f"out-{name}", warm)()

        seconds: dict[str, list[float]] = {name: [] for name in JOBS}
        for r in range(rounds):
            for name in JOBS:
                progress(f"{name}" + (f" (round {r + 1}/{rounds})" if rounds > 1 else ""))
                out = root / f"out-{name}-{r}"
                start = time.perf_counter()
                job(name, out, parquet)()
                seconds[name].append(time.perf_counter() - start)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if own_client is not None:
            cluster = own_client.cluster
            own_client.close()
            cluster.close()
        shutil.rmtree(root, ignore_errors=True)

    return _figures(rows, rounds, mb, seconds)


def native_dask_on(client, source: str, out: str, cfg: PipelineConfig) -> None:
    """native_dask on `client`: a user's dask.dataframe code runs on the default client,
    which need not be the one given to `run`."""
    with client.as_current():
        native_dask(source, out, cfg)


def _warm_input(dask: DaskEngine, root: Path, rows: int, parquet: PipelineConfig) -> PipelineConfig:
    """The warm-up's input: the measured one when it has at most WARM_ROWS rows, else
    WARM_ROWS rows generated beside it."""
    if rows <= WARM_ROWS:  # the measured input itself
        return parquet
    warm = bench_config(root / "warm", WARM_ROWS)
    generate(dask, warm.source.synthetic, warm.source.path)
    return warm.model_copy(update={"source": warm.source.model_copy(update={"format": "parquet"})})


def _figures(rows: int, rounds: int, mb: float, seconds: dict[str, list[float]]) -> dict:
    """The benchmark's one JSON object: each job's best round, as MB/s and as ratios."""
    best = {k: min(v) for k, v in seconds.items()}
    mbps = {k: mb / v for k, v in best.items()}
    return {
        "benchmark": "prepare",
        "rows": rows,
        "rounds": rounds,
        # Microsecond precision: a tiny run's fastest job takes ~0.02 s, where rounding
        # to ms would move the MB/s figure by several percent.
        "input_mb": round(mb, 6),
        "seconds": {k: round(v, 6) for k, v in best.items()},
        "seconds_per_round": {k: [round(x, 6) for x in v] for k, v in seconds.items()},
        "mb_per_s": {k: round(v, 4) for k, v in mbps.items()},
        "ratio_vs_native": {e: round(mbps[e] / mbps[f"{e}_native"], 4) for e in ("spark", "dask")},
        "ratio_vs_pyarrow": {k: round(mbps[k] / mbps["pyarrow"], 4) for k in JOBS if k != "pyarrow"},
        "cores": len(os.sched_getaffinity(0)),
    }


if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)))
