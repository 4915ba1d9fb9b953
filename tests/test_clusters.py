"""Real clusters started the way users start them (tests/fixtures_clusters.py: a Spark
standalone Master and Workers from spark-class, no Spark distribution; a Dask CLI
scheduler and workers), and spark-submit overriding the configured master."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from .conftest import REPO, shardline_here
from .faults_helpers import stop_group, wait_for
from .mlflow_store import empty_store, env_without_store

BIN = Path(sys.executable).parent
QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"
# What conftest.shardline allows a CLI run; the same bound for waiting on one here.
CLI_TIMEOUT_S = 600


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


def _shardline_in_background(*args: str, cwd: Path, env: dict) -> tuple[subprocess.Popen, Path]:
    """The real CLI as conftest.shardline runs it (default store cwd/mlflow.db), not waited
    for: its stderr goes to a file the test reads while the job runs. Its own session, so
    that stop_group ends its ranks with it."""
    base = env_without_store()
    stderr = cwd / "shardline.stderr"
    with open(cwd / "shardline.stdout", "wb") as out, open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "shardline.jobs.cli", *args], cwd=cwd, env={**base, **env},
                                stdout=out, stderr=err, start_new_session=True)
    return proc, stderr


@pytest.mark.slow
@pytest.mark.cluster
def test_spark_standalone_cluster_runs_the_barrier_stage(prepared, spark_standalone, tmp_path):
    """A job trains on the cluster's 2 slots; a job wanting 4 ranks is refused before any
    task starts; and spark-submit's --master wins over the configured one.

    The refused job is the spark-submit one (one driver JVM for both proofs: each costs
    ~15 s): the quickstart config says local[2], spark-submit names the cluster, and the
    refusal names the cluster. It runs while the first job trains: that job holds both of
    the cluster's cores by then (its executors ran the environment probe), so the second
    application gets no executor and cannot disturb it; the refusal needs none (the slots
    come from spark.cores.max)."""
    cluster = [a for s in (f"spark.master='{spark_standalone.master}'", f"spark.conf={spark_standalone.conf}")
               for a in ("--set", s)]
    empty_store(tmp_path)  # its default store, without MLflow's migrations (tests/mlflow_store.py)
    train, train_log = _shardline_in_background("train", str(QUICKSTART), *_train_args(prepared, tmp_path, *cluster),
                                                cwd=tmp_path, env=spark_standalone.env)
    try:
        # An exit before this line fails here with the job's log: nothing more is started.
        wait_for(lambda: "Training mlp with ddp on 2 spark ranks" in train_log.read_text(errors="replace"),
                 "the first job's training line", within_s=CLI_TIMEOUT_S, proc=train, log=train_log)
        # Too many ranks for the cluster's 2 slots: refused before any task starts. Two of the
        # four are parameter servers, so the dataset's 2 shards feed the 2 data ranks (the
        # dataset is checked before Spark starts; the slots once it runs). The cluster's
        # settings go to spark-submit itself: it started the JVM, so they cannot come later.
        conf = tomllib.loads(f"conf = {spark_standalone.conf}")["conf"]
        submit = tmp_path / "submitted"
        submit.mkdir()
        ps = ["--set", "training.strategy='ps'", "--set", "training.ps.servers=2", "--world-size", "4",
              "--set", f"training.checkpoint_dir='{tmp_path / 'ckpt-ps'}'"]  # not the first job's
        submitted = subprocess.run(
            [str(BIN / "spark-submit"), "--master", spark_standalone.master,
             *[a for k, v in conf.items() for a in ("--conf", f"{k}={v}")],
             str(REPO / "jobs" / "spark_submit.py"), "train", str(QUICKSTART), *_train_args(prepared, tmp_path, *ps)],
            cwd=submit, env={**os.environ, **spark_standalone.env}, capture_output=True, text=True,
            timeout=CLI_TIMEOUT_S,
        )  # fmt: skip
        train.wait(timeout=CLI_TIMEOUT_S)
    finally:
        if train.poll() is None:
            stop_group(train)
    stderr = train_log.read_text(errors="replace")
    assert train.returncode == 0, stderr[-3000:]
    assert "val_accuracy" in stderr
    # Executors' stderr goes to the workers' logs: the line came through the progress listener.
    assert "[shardline] epoch 1/1: " in stderr, stderr[-2000:]

    assert submitted.returncode == 1, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    # spark-submit merges the Python driver's stderr into its stdout.
    master = spark_standalone.master
    errors = [ln for ln in submitted.stdout.splitlines() if ln.startswith("error:")]
    assert errors == [
        f"error: training.world_size 4 is greater than the 2 task slots of Spark master {master} "
        "(spark.cores.max=2): a barrier stage needs them all at once"
    ], submitted.stdout[-1500:]
    # The session's own line: the master spark-submit named, not the config's local[2].
    assert f"  Spark master {master}" in submitted.stdout.splitlines(), submitted.stdout[-1500:]


@pytest.mark.slow
@pytest.mark.cluster
def test_dask_cli_cluster_runs_one_rank_per_worker(prepared, dask_cli_cluster, tmp_path):
    """The CLI in this process (`shardline_here`): what is tested is the cluster's side (ranks
    on workers that lack shardline, their lines back through the listener); a subprocess
    would only add a Python start and its imports."""
    empty_store(tmp_path)  # its default store, without MLflow's migrations (tests/mlflow_store.py)
    proc = shardline_here(
        "train", str(QUICKSTART),
        *_train_args(prepared, tmp_path, "--launcher", "dask", "--set", f"dask.address='{dask_cli_cluster.address}'"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val_accuracy" in proc.stderr
    # Dask CLI workers log to their own stderr: the line came through the progress listener.
    assert "[shardline] epoch 1/1: " in proc.stderr, proc.stderr[-2000:]
