"""A real Spark Connect server, one per test session, started the way users start one:
`sbin/start-connect-server.sh` from the pyspark package, bound to loopback.

It is its own JVM (beside the classic `local[2]` session of conftest). Its
executors run this venv's Python but do not see this repo on their PYTHONPATH:
shardline's packages reach them only as the client's artifacts, as on a real
server. Tests talk to it through the CLI in another process: one Python process
cannot hold a classic and a Connect session at once (pyspark's functions pick
their implementation per process). `connect_cli` is one such process for the whole
session (tests/connect_client.py); a command for another server, or one whose setting
would stay in the shared session, runs in a subprocess of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .connect_client import ConnectClient

SPARK_HOME = Path(__import__("pyspark").__file__).parent
LOG4J = Path(__file__).resolve().parent.parent / "shardline" / "foundation" / "log4j2.properties"


@dataclass
class ConnectServer:
    url: str
    root: Path  # its working, log and pid directories
    env: dict

    def log_tail(self, chars: int = 3000) -> str:
        logs = sorted((self.root / "log").glob("*.out"))
        return logs[-1].read_text(errors="replace")[-chars:] if logs else "(no log)"

    def stop(self) -> None:
        pids = [int(p.read_text()) for p in (self.root / "pid").glob("*.pid")]
        subprocess.run(
            [str(SPARK_HOME / "sbin" / "stop-connect-server.sh")],
            env=self.env, cwd=self.root, capture_output=True, timeout=120,
        )
        deadline = time.monotonic() + 60
        for pid in pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_connect_server(root: Path, python: str = sys.executable, name: str = "shardline-test",
                         conf: dict[str, str] | None = None) -> ConnectServer:
    """Start a Connect server on a free loopback port, its executors running `python`;
    return once it accepts connections. The caller stops it (also on failure)."""
    from shardline.training.launchers import free_port

    port = free_port()
    for d in ("pid", "log", "conf"):
        (root / d).mkdir(parents=True, exist_ok=True)
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_CONF_DIR")
    }
    env.update(
        SPARK_HOME=str(SPARK_HOME),
        PYSPARK_PYTHON=python,
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_PID_DIR=str(root / "pid"),
        SPARK_LOG_DIR=str(root / "log"),
        SPARK_IDENT_STRING=name,
        SPARK_CONF_DIR=str(root / "conf"),  # empty: no stray spark-defaults.conf
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    settings = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.ui.enabled": "false",
        **(conf or {}),
    }
    cmd = [str(SPARK_HOME / "sbin" / "start-connect-server.sh"), "--master", "local[2]",
           "--driver-java-options", f"-Dlog4j2.configurationFile=file:{LOG4J}"]
    for k, v in settings.items():
        cmd += ["--conf", f"{k}={v}"]
    server = ConnectServer(f"sc://127.0.0.1:{port}", root, env)
    subprocess.run(cmd, env=env, cwd=root, check=True, capture_output=True, timeout=120)
    try:
        _wait_port(port, 300, server)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_port(port: int, seconds: float, server: ConnectServer) -> None:
    from .fixtures_clusters import _wait_port as wait

    try:
        wait(port, seconds)
    except AssertionError as e:
        raise AssertionError(f"Spark Connect server: {e}:\n{server.log_tail()}") from None


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory) -> ConnectServer:
    server = start_connect_server(tmp_path_factory.mktemp("connect-server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def connect_cli(connect_server, tmp_path_factory) -> ConnectClient:
    """`connect_cli.run(*args, cwd=...)`: the CLI in the session's one Connect client process."""
    client = ConnectClient(tmp_path_factory.mktemp("connect-client") / "client.log")
    try:
        yield client
    finally:
        client.close()
