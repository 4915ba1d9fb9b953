"""`shardline bench loader --storage s3`: the loader on the same shards from S3 and from local disk.

One run: a synthetic dataset is prepared on local disk (Dask), then copied object by
object into an S3 bucket (manifest and shards, the same bytes). Each figure is one
epoch of `ShardLoader` (rank 0 of 1, shuffle on, its defaults), best of REPEATS,
the two stores alternating: samples / seconds from opening the loader to its last
batch. The ratio is S3 / local.

Without `s3_url` a moto S3 server is started on loopback for the run (moto[server],
a test dependency) and stopped after; the figure then measures the S3 protocol path
(HTTP, ranged GETs, pyarrow's S3 client) on this machine, not a network. With
`s3_url` (s3://bucket/prefix) the standard AWS chain reaches a real store; the
objects written under it are removed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

from shardline.benchmarks import prepare_with_dask, synthetic_pipeline
from shardline.benchmarks.loader import BATCH_SIZE, REPEATS, SEED, ours_batches, timed_epoch
from shardline.benchmarks.s3_server import loopback_bucket, stop_loopback
from shardline.foundation import storage
from shardline.pipelines.manifest import load_manifest

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs).


def run(rows: int, s3_url: str | None = None, workdir: str | None = None, progress=print) -> dict:
    import torch

    root = Path(tempfile.mkdtemp(prefix="shardline-bench-s3-", dir=workdir))
    server, saved_env = None, dict(os.environ)
    threads = torch.get_num_threads()
    target = None
    try:
        if s3_url is None:
            server, s3_url = loopback_bucket(root, progress)
        cfg = synthetic_pipeline(root, rows)
        prepare_with_dask(cfg, progress)  # on local disk
        local = cfg.dataset_dir
        target = storage.join(s3_url, f"bench-{uuid.uuid4().hex[:8]}")
        progress(f"copying the dataset to {target}")
        copied = 0
        for f in storage.find_files(local):
            rel = f[len(local) + 1 :]
            if not rel.startswith(("_lease", ".")):
                data = storage.read_bytes(f)
                storage.write_bytes(storage.join(target, rel), data)
                copied += len(data)
        manifests = {"local": load_manifest(local), "s3": load_manifest(target)}
        width = manifests["local"].tensors["features"].shape[0]

        torch.set_num_threads(1)  # as `bench loader`: one torch thread, the loader's own workers
        samples: dict[str, int] = {}
        seconds: dict[str, float] = {}
        for attempt in range(REPEATS):
            for name, where in (("local", local), ("s3", target)):
                progress(f"{name}: epoch {attempt + 1} of {REPEATS}")
                n, s = timed_epoch(ours_batches(manifests[name], where, BATCH_SIZE, SEED), width, BATCH_SIZE)
                if name not in seconds or s < seconds[name]:
                    samples[name], seconds[name] = n, s
        train = manifests["local"].split("train")
    finally:
        torch.set_num_threads(threads)
        if target is not None:
            storage.delete_tree(target)
        if server is not None:
            stop_loopback(server, saved_env)
        shutil.rmtree(root, ignore_errors=True)

    sps = {k: samples[k] / seconds[k] for k in seconds}
    return {
        "benchmark": "loader-storage",
        "rows": rows,
        "train_rows": train.rows,
        "train_shards": len(train.shards),
        "train_bytes": sum(s.bytes for s in train.shards),
        "copied_bytes": copied,
        "feature_width": width,
        "batch_size": BATCH_SIZE,
        "repeats": REPEATS,
        "s3": "moto_server on loopback" if server is not None else "the AWS chain's endpoint",
        "samples": samples,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "samples_per_s": {k: round(v, 1) for k, v in sps.items()},
        "ratio_s3_vs_local": round(sps["s3"] / sps["local"], 3),
    }
