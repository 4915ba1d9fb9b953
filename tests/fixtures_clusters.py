"""Real clusters, started once per session the way users start them, shared by the tests
that need one: a Spark standalone Master with two one-core Workers (spark-class from
pyspark's own jars, no Spark distribution), and a Dask CLI scheduler with two
single-threaded workers. Each is up (its workers registered) before a test sees it,
and stopped, process group and all, at the end of the session, also after a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardline.training.launchers import free_port

BIN = Path(sys.executable).parent
# Starting a JVM or a worker on a loaded 2-core machine takes minutes; a live cluster
# answers long before these, and a dead one fails at once (its process exited).
UP_WITHIN_S = 300


@dataclass(frozen=True)
class SparkStandalone:
    master: str  # spark://127.0.0.1:<port>
    env: dict[str, str]  # what a driver on this machine needs to reach it
    conf: str  # `spark.conf` as a TOML inline table for `--set`: one core per executor, both slots
    # The executors a worker starts for an application are JVMs too, started with the
    # application's spark.executor.extraJavaOptions only (neither SPARK_SUBMIT_OPTS nor the
    # daemons' SPARK_DAEMON_JAVA_OPTS reach them): the daemons' flags (conftest.TEST_JVM_OPTS
    # and the class archive's: speed, not behaviour), given in `conf` and by the tests that
    # write their own.
    executor_java_opts: str


@dataclass(frozen=True)
class DaskCliCluster:
    address: str  # tcp://127.0.0.1:<port>


def _start(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    # Its own session: stopping the group takes the JVM or worker and all its children.
    with open(log, "wb") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})}, cwd=cwd)


def _without_shardline(tmp: Path) -> tuple[list[str], dict, Path]:
    """How to start a Python that has shardline's dependencies but not shardline, as a
    cluster's workers have: `-S` skips site-packages' .pth files (the editable install is
    one), PYTHONPATH gives the dependencies back, and the working folder is empty."""
    import sysconfig

    cwd = tmp / "bare"
    cwd.mkdir(exist_ok=True)
    return [sys.executable, "-S"], {"PYTHONPATH": sysconfig.get_paths()["purelib"]}, cwd


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _wait(ready, what: str, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Until `ready()`; fail at once if a process died, or after UP_WITHIN_S, with its logs."""
    deadline = time.monotonic() + UP_WITHIN_S
    while not ready():
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}" for log in logs)
            raise AssertionError(f"{what}: {'exited: ' + str(dead) if dead else f'not within {UP_WITHIN_S} s'}\n{tails}")
        time.sleep(0.3)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_port(port: int, seconds: float = UP_WITHIN_S) -> None:
    """Until something listens on 127.0.0.1:`port`, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not _listening(port):
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")
        time.sleep(0.3)


def _alive_spark_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=10) as r:
            return int(json.loads(r.read())["aliveworkers"])
    # ValueError: while the master starts, /json/ can answer with its HTML page (seen in CI,
    # Spark 4.3, 2026-11-26: the session's cluster fixture failed at setup on it).
    except (OSError, ValueError, KeyError):
        return 0


@pytest.fixture(scope="session")
def spark_standalone(tmp_path_factory) -> SparkStandalone:
    tmp = tmp_path_factory.mktemp("spark-standalone")
    env = {
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    port, ui = free_port(), free_port()
    executor_opts = os.environ.get("SPARK_DAEMON_JAVA_OPTS", "")  # the daemons' own, for their executors
    logs = [tmp / "master.log"]
    procs = [_start([str(BIN / "spark-class"), "org.apache.spark.deploy.master.Master", "--host",
                     "127.0.0.1", "--port", str(port), "--webui-port", str(ui)], logs[0], env)]
    try:
        _wait(lambda: _listening(port), "Spark master", procs, logs)
        for i in range(2):
            logs.append(tmp / f"worker{i}.log")
            procs.append(_start(
                [str(BIN / "spark-class"), "org.apache.spark.deploy.worker.Worker",
                 f"spark://127.0.0.1:{port}", "--cores", "1", "--memory", "1g",
                 "--work-dir", str(tmp / f"work{i}"), "--host", "127.0.0.1",
                 "--webui-port", str(free_port())],
                logs[-1], env,
            ))
        # Registered with the master: a driver started now sees both slots.
        _wait(lambda: _alive_spark_workers(ui) == 2, "Spark workers registering", procs, logs)
        yield SparkStandalone(
            master=f"spark://127.0.0.1:{port}",
            env=env,
            conf="{'spark.executor.cores' = '1', 'spark.cores.max' = '2', "
                 "'spark.driver.host' = '127.0.0.1', 'spark.driver.bindAddress' = '127.0.0.1', "
                 f"'spark.executor.extraJavaOptions' = '{executor_opts}'}}",
            executor_java_opts=executor_opts,
        )
    finally:
        _stop(procs)


@pytest.fixture(scope="session")
def dask_cli_cluster(tmp_path_factory) -> DaskCliCluster:
    from distributed import Client

    tmp = tmp_path_factory.mktemp("dask-cli")
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    logs = [tmp / "scheduler.log"]
    procs = [_start([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                     "--dashboard-address", ":0"], logs[0])]
    try:
        _wait(lambda: _listening(port), "Dask scheduler", procs, logs)
        # Workers lacking shardline (its dependencies only): shardline ships its own
        # packages to them (a worker plugin), and every test on this cluster proves it.
        python, env, cwd = _without_shardline(tmp)
        for i in range(2):
            logs.append(tmp / f"worker{i}.log")
            procs.append(_start([*python, "-m", "distributed.cli.dask_worker", address, "--nworkers", "1",
                                 "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"], logs[-1],
                                env, cwd))  # fmt: skip
        with Client(address, timeout="60s") as client:
            _wait(lambda: len(client.scheduler_info()["workers"]) == 2, "Dask workers registering",
                  procs, logs)
            def imports_shardline() -> bool:  # nested: pickled by value, the workers lack `tests`
                import importlib.util

                return importlib.util.find_spec("shardline") is not None

            has = client.run(imports_shardline)
            assert not any(has.values()), f"the workers already import shardline: {has}"
        yield DaskCliCluster(address=address)
    finally:
        _stop(procs)
