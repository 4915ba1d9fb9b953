"""`shardline bench loader --storage s3` at a tiny size: both figures and their ratio, one JSON
object, its own S3 server started and stopped (no timing claims).

Full tier only (`make test-all`, marker `slow`): the CLI in a process of its own, starting its own
S3 server.
"""

from __future__ import annotations

import json

import pytest

from .conftest import shardline

pytestmark = pytest.mark.slow


def test_bench_loader_s3_tiny(tmp_path):
    # Without --s3-url the bench starts its own moto server on loopback, whatever the
    # environment points at: the session's S3 variables must not matter.
    proc = shardline("bench", "loader", "--storage", "s3", "--rows", "20000", "--json", cwd=tmp_path,
                     env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["benchmark"] == "loader-storage" and result["s3"] == "moto_server on loopback"
    assert result["samples"]["local"] == result["samples"]["s3"] > 0  # the same batches from both
    assert result["copied_bytes"] >= result["train_bytes"] > 0
    figures = [*result["seconds"].values(), *result["samples_per_s"].values(), result["ratio_s3_vs_local"]]
    assert all(isinstance(v, (int, float)) and v > 0 for v in figures)
    assert abs(result["ratio_s3_vs_local"] - result["samples_per_s"]["s3"] / result["samples_per_s"]["local"]) < 0.01
    assert list(tmp_path.iterdir()) == []


def test_bench_loader_s3_url_must_be_reachable(s3, tmp_path):
    proc = shardline("bench", "loader", "--storage", "s3", "--s3-url", "s3://no-such-bench-bucket/x",
                     "--rows", "1000", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "error: --s3-url: s3://no-such-bench-bucket/x: bucket 'no-such-bench-bucket' does not exist" in proc.stderr
