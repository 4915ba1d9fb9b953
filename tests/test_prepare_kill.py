"""A prepare killed mid-write leaves the previous dataset intact and no partial one visible.

Full tier only (`make test-all`, marker `slow`): it SIGKILLs a CLI process in the middle of its
writes.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.pipelines.manifest import load_manifest, manifest_url
from shardline.pipelines.prepare import prepare

from .conftest import REPO, small_pipeline

pytestmark = pytest.mark.slow


def test_kill_during_shard_writes(engines, tmp_path):
    cfg = small_pipeline(tmp_path, rows=3000)
    previous = prepare(engines["dask"], cfg)
    manifest = Path(manifest_url(cfg.dataset_dir, previous.sequence))
    manifest_bytes = manifest.read_bytes()

    # A bigger prepare of the same dataset, in its own process group (Spark's JVM and
    # Python workers included), with many small shards so the write phase lasts.
    overrides = {
        "pipelines.dataset_dir": f"'{cfg.dataset_dir}'",
        "pipelines.source.path": f"'{tmp_path / 'raw-big'}'",
        "pipelines.source.synthetic.rows": "1000000",
        "pipelines.layout.target_shard_bytes": "262144",
    }
    args = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardline.jobs.cli", "prepare", str(REPO / "jobs/configs/quickstart.toml"), *args],
        cwd=tmp_path,
        # Spark's scratch (a killed JVM leaves its shuffle files, ~50 MB) in pytest's folder, not /tmp.
        env={**os.environ, "SPARK_LOCAL_DIRS": str(tmp_path / "spark-local")},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    old_dir = f"v-{previous.version_id}"
    deadline = time.monotonic() + 300
    written = []
    try:
        while time.monotonic() < deadline and proc.poll() is None and not written:
            written = [
                p
                for d in Path(cfg.dataset_dir).glob("v-*")
                if d.name != old_dir
                for p in d.rglob("*.parquet")
            ]
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert written, f"prepare ended before writing a shard: {proc.stderr.read().decode()[-2000:]}"

    # Mid-write: shards of the new version exist, but nothing names them.
    assert manifest.read_bytes() == manifest_bytes
    assert [p.name for p in manifest.parent.iterdir()] == [manifest.name]
    m = load_manifest(cfg.dataset_dir)
    assert m == previous
    for info in m.splits.values():
        for shard in info.shards:
            data = (Path(cfg.dataset_dir) / shard.path).read_bytes()
            assert hashlib.sha256(data).hexdigest() == shard.sha256

    # The next prepare removes the orphaned version and commits normally (the previous
    # version stays for the default retention).
    again = prepare(engines["dask"], cfg)
    assert sorted(p.name for p in Path(cfg.dataset_dir).iterdir()) == sorted(
        ["_manifests", f"v-{previous.version_id}", f"v-{again.version_id}"]
    )
