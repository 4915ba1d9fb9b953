"""Real clusters started the way users start them: a Spark standalone Master and Workers
(spark-class, no Spark distribution), and a Dask CLI scheduler and workers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from training.launchers import free_port

from .conftest import REPO, shardline

BIN = Path(sys.executable).parent
QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"


def _start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def _wait_port(port: int, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


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


def test_spark_standalone_cluster_runs_the_barrier_stage(prepared, tmp_path):
    env = {
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    port, ui = free_port(), free_port()
    master = _start(
        [str(BIN / "spark-class"), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
         "--port", str(port), "--webui-port", str(ui)],
        tmp_path / "master.log", env,
    )
    procs = [master]
    try:
        _wait_port(port)
        for i in range(2):
            procs.append(_start(
                [str(BIN / "spark-class"), "org.apache.spark.deploy.worker.Worker",
                 f"spark://127.0.0.1:{port}", "--cores", "1", "--memory", "1g",
                 "--work-dir", str(tmp_path / f"work{i}"), "--host", "127.0.0.1",
                 "--webui-port", str(free_port())],
                tmp_path / f"worker{i}.log", env,
            ))
        conf = (
            "{'spark.executor.cores' = '1', 'spark.cores.max' = '2', "
            "'spark.driver.host' = '127.0.0.1', 'spark.driver.bindAddress' = '127.0.0.1'}"
        )
        proc = shardline(
            "train", str(QUICKSTART),
            *_train_args(prepared, tmp_path, "--set", f"spark.master='spark://127.0.0.1:{port}'",
                         "--set", f"spark.conf={conf}"),
            cwd=tmp_path, env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "val_accuracy" in proc.stderr
        # Too many ranks for the cluster's 2 slots: refused before any task starts.
        proc = shardline(
            "train", str(QUICKSTART),
            *_train_args(prepared, tmp_path, "--set", f"spark.master='spark://127.0.0.1:{port}'",
                         "--set", f"spark.conf={conf}", "--world-size", "4"),
            cwd=tmp_path, env=env,
        )
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "world_size 4 is greater than the 2 task slots" in proc.stderr
    finally:
        _stop(procs)


def test_dask_cli_cluster_runs_one_rank_per_worker(prepared, tmp_path):
    port = free_port()
    procs = [_start([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                     "--dashboard-address", ":0"], tmp_path / "scheduler.log")]
    try:
        _wait_port(port)
        for i in range(2):
            procs.append(_start(
                [str(BIN / "dask"), "worker", f"tcp://127.0.0.1:{port}", "--nworkers", "1",
                 "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
                tmp_path / f"dworker{i}.log",
            ))
        proc = shardline(
            "train", str(QUICKSTART),
            *_train_args(prepared, tmp_path, "--launcher", "dask", "--set",
                         f"dask.address='tcp://127.0.0.1:{port}'"),
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "val_accuracy" in proc.stderr
    finally:
        _stop(procs)



def test_spark_submit_master_wins_over_the_config(prepared, tmp_path):
    # The config says local[2]; spark-submit says local[1]: one slot, so two ranks are refused.
    env = {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run(
        [str(BIN / "spark-submit"), "--master", "local[1]", str(REPO / "jobs" / "spark_submit.py"),
         "train", str(QUICKSTART), *_train_args(prepared, tmp_path)],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    # spark-submit merges the Python driver's stderr into its stdout.
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error:")]
    assert errors == [
        "error: training.world_size 2 is greater than the 1 task slots of Spark master "
        "local[1]: a barrier stage needs them all at once"
    ], proc.stdout[-1500:]
    assert "Spark master local[1]" in proc.stdout
