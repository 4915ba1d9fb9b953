"""Real clusters started the way users start them (tests/fixtures_clusters.py: a Spark
standalone Master and Workers from spark-class, no Spark distribution; a Dask CLI
scheduler and workers), and spark-submit overriding the configured master."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, shardline

BIN = Path(sys.executable).parent
QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"


def _train_args(prepared, tmp_path, *more: str) -> list[str]:
    sets = {
        "pipelines.dataset_dir": f"'{prepared.dataset_dir}'",
        "training.epochs": "1",
        "training.batch_size": "256",
        "training.checkpoint_dir": f"'{tmp_path / 'ckpt'}'",
        "tracking.experiment": "'clusters'",
        "tracking.registered_model": "'clusters'",
    }
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")] + list(more)


@pytest.mark.slow
@pytest.mark.cluster
def test_spark_standalone_cluster_runs_the_barrier_stage(prepared, spark_standalone, tmp_path):
    cluster = [a for s in (f"spark.master='{spark_standalone.master}'", f"spark.conf={spark_standalone.conf}")
               for a in ("--set", s)]
    proc = shardline("train", str(QUICKSTART), *_train_args(prepared, tmp_path, *cluster),
                     cwd=tmp_path, env=spark_standalone.env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val_accuracy" in proc.stderr
    # Executors' stderr goes to the workers' logs: the line came through the progress listener.
    assert "[shardline] epoch 1/1: " in proc.stderr, proc.stderr[-2000:]
    # Too many ranks for the cluster's 2 slots: refused before any task starts. Two of the
    # four are parameter servers, so the dataset's 2 shards feed the 2 data ranks (the
    # dataset is checked before Spark starts; the slots once it runs).
    ps = ["--set", "training.strategy='ps'", "--set", "training.ps_servers=2", "--world-size", "4",
          "--set", f"training.checkpoint_dir='{tmp_path / 'ckpt-ps'}'"]  # not the first job's
    proc = shardline("train", str(QUICKSTART), *_train_args(prepared, tmp_path, *cluster, *ps),
                     cwd=tmp_path, env=spark_standalone.env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "world_size 4 is greater than the 2 task slots" in proc.stderr


@pytest.mark.slow
@pytest.mark.cluster
def test_dask_cli_cluster_runs_one_rank_per_worker(prepared, dask_cli_cluster, tmp_path):
    proc = shardline(
        "train", str(QUICKSTART),
        *_train_args(prepared, tmp_path, "--launcher", "dask", "--set", f"dask.address='{dask_cli_cluster.address}'"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val_accuracy" in proc.stderr
    # Dask CLI workers log to their own stderr: the line came through the progress listener.
    assert "[shardline] epoch 1/1: " in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_spark_submit_master_wins_over_the_config(prepared, tmp_path):
    # The config says local[2]; spark-submit says local[1]: one slot, so two ranks are refused.
    env = {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run(
        [str(BIN / "spark-submit"), "--master", "local[1]", str(REPO / "jobs" / "spark_submit.py"),
         "train", str(QUICKSTART), *_train_args(prepared, tmp_path)],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    # spark-submit merges the Python driver's stderr into its stdout.
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error:")]
    assert errors == [
        "error: training.world_size 2 is greater than the 1 task slots of Spark master "
        "local[1]: a barrier stage needs them all at once"
    ], proc.stdout[-1500:]
    assert "Spark master local[1]" in proc.stdout
