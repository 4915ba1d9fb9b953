"""Peak memory of the driver/client process during a prepare, to show it does not grow with rows.

    python -m benchmarks.memory --engine dask --rows 10000000 --workdir /tmp

Prints one JSON object. The figure is this Python process's peak RSS
(getrusage RUSAGE_SELF): the Spark driver or the Dask client. Spark's JVM and
Dask's workers are other processes and do the row work.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

from pipelines.config import DaskConfig, PipelineConfig, SparkConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["spark", "dask"], required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from pipelines.prepare import prepare

    root = Path(tempfile.mkdtemp(prefix="shardline-mem-", dir=args.workdir))
    cfg = PipelineConfig.model_validate(
        {
            "engine": args.engine,
            "dataset_dir": str(root / "dataset"),
            "source": {"format": "synthetic", "path": str(root / "raw"), "synthetic": {"rows": args.rows, "partitions": 16}},
        }
    )
    try:
        if args.engine == "spark":
            from pipelines.engine_spark import SparkEngine
            from pipelines.engines import spark_session

            engine = SparkEngine(spark_session(SparkConfig()))
        else:
            from pipelines.engine_dask import DaskEngine
            from pipelines.engines import dask_client

            engine = DaskEngine(dask_client(DaskConfig()))
        start = time.perf_counter()
        m = prepare(engine, cfg)
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "engine": args.engine,
                "rows": sum(s.rows for s in m.splits.values()),
                "shards": sum(len(s.shards) for s in m.splits.values()),
                "seconds": round(seconds, 1),
                "client_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
