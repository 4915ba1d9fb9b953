"""Peak memory of the driver/client process during a prepare, to show it does not grow with rows.

    python -m shardline.benchmarks.memory --engine dask --rows 10000000 --workdir /tmp
    python -m shardline.benchmarks.memory --engine spark --rows 10000000 --s3     # raw data and dataset on S3

--s3: the raw files and the dataset in a bucket of an S3 server (moto) started on
loopback for the run; --s3-url s3://bucket/prefix uses the AWS chain's store instead.

Prints one JSON object. The figure is this Python process's peak RSS
(getrusage RUSAGE_SELF): the Spark driver or the Dask client. Spark's JVM and
Dask's workers are other processes and do the row work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from shardline.config import ShardlineConfig
from shardline.engines import engine_class
from shardline.foundation import storage
from shardline.pipelines.config import PipelineConfig

# Imported inside the functions that use them: pipelines.prepare (imports pandas).


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["spark", "dask"], required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--s3", action="store_true", help="data on an S3 server started on loopback")
    ap.add_argument("--s3-url", default=None, help="data under this s3:// prefix (the AWS chain's store)")
    args = ap.parse_args()

    from shardline.pipelines.prepare import prepare

    root = Path(tempfile.mkdtemp(prefix="shardline-mem-", dir=args.workdir))
    server, saved_env, where = None, dict(os.environ), str(root)
    if args.s3 and not args.s3_url:
        from shardline.benchmarks.s3_server import loopback_bucket

        # Before any engine starts: its workers inherit the AWS variables.
        server, where = loopback_bucket(root, progress=lambda msg: None)
    elif args.s3_url:
        where = storage.join(args.s3_url, f"mem-{os.getpid()}")
    cfg = PipelineConfig.model_validate(
        {
            "engine": args.engine,
            "dataset_dir": storage.join(where, "dataset"),
            "source": {
                "format": "synthetic",
                "path": storage.join(where, "raw"),
                "synthetic": {"rows": args.rows, "partitions": 16},
            },
        }
    )
    try:
        engine = engine_class(args.engine, "--engine").open(ShardlineConfig())
        start = time.perf_counter()
        m = prepare(engine, cfg)
        seconds = time.perf_counter() - start
    finally:
        if storage.is_remote(where):
            storage.delete_tree(where)
        if server is not None:
            from shardline.benchmarks.s3_server import stop_loopback

            stop_loopback(server, saved_env)
        shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "engine": args.engine,
                "storage": "s3" if storage.is_remote(where) else "local",
                "rows": sum(s.rows for s in m.splits.values()),
                "shards": sum(len(s.shards) for s in m.splits.values()),
                "seconds": round(seconds, 1),
                "client_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
