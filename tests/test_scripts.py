"""The cluster scripts in jobs/scripts/, run as a user runs them: started with ports as
arguments, ready only once their health check says so, every socket on loopback, the Dask
dashboard served (bokeh installed), and everything gone after one SIGTERM to the script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fixtures_clusters import UP_WITHIN_S, _start, _stop, _wait
from shardline.training.launchers import free_port

SCRIPTS = REPO / "jobs" / "scripts"
VENV = str(Path(sys.executable).parent.parent)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200, url
        return r.read()


def _group(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _listening_addresses(pgid: int) -> list[str]:
    """Local addresses of every TCP socket the script's processes listen on."""
    pids = {f"pid={p}," for p in _group(pgid)}
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    return [line.split()[3] for line in lines if any(p in line for p in pids)]


def _on_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host in ("127.0.0.1", "[::ffff:127.0.0.1]")


def _run_script(args: list[str], log: Path) -> subprocess.Popen:
    proc = _start(["bash", *args, "--venv", VENV], log)
    _wait(lambda: "ready: " in log.read_text(errors="replace"), args[0], [proc], [log])
    return proc


def _stops_on_sigterm(proc: subprocess.Popen) -> None:
    """One SIGTERM to the script (not its group): it stops every daemon it started."""
    os.kill(proc.pid, signal.SIGTERM)
    # The script waits for its daemons before it exits (reaped here, or ps lists a zombie).
    assert proc.wait(timeout=UP_WITHIN_S) == 143
    deadline = time.monotonic() + 60
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _group(proc.pid) == [], "the script left processes running"


@pytest.mark.slow
@pytest.mark.cluster
def test_dask_cluster_script(tmp_path):
    from distributed import Client

    port, dashboard = free_port(), free_port()
    log = tmp_path / "dask.log"
    proc = _run_script([str(SCRIPTS / "dask-cluster.sh"), "--workers", "2", "--port", str(port),
                        "--dashboard-port", str(dashboard)], log)
    try:
        assert f"ready: tcp://127.0.0.1:{port}, 2 workers" in log.read_text()
        assert _get(f"http://127.0.0.1:{dashboard}/health") == b"ok"
        assert json.loads(_get(f"http://127.0.0.1:{dashboard}/json/counts.json"))["workers"] == 2
        # The dashboard itself: Bokeh's page, not distributed's "Dask needs bokeh" stand-in.
        status = _get(f"http://127.0.0.1:{dashboard}/status").decode()
        assert "Dask Diagnostic UI" in status and "bokeh.min.js" in status
        addresses = _listening_addresses(proc.pid)
        assert f"127.0.0.1:{port}" in addresses and f"127.0.0.1:{dashboard}" in addresses
        assert all(_on_loopback(a) for a in addresses), addresses
        with Client(f"tcp://127.0.0.1:{port}", timeout="60s") as client:
            assert len(client.run(os.getpid)) == 2 and client.submit(sum, [1, 2]).result() == 3
        _stops_on_sigterm(proc)
    finally:
        _stop([proc])


@pytest.mark.slow
@pytest.mark.cluster
def test_spark_standalone_script(tmp_path):
    port, webui = free_port(), free_port()
    log = tmp_path / "spark.log"
    proc = _run_script([str(SCRIPTS / "spark-standalone.sh"), "--workers", "2", "--port", str(port),
                        "--webui-port", str(webui), "--work-dir", str(tmp_path / "work")], log)
    try:
        assert f"ready: spark://127.0.0.1:{port}, 2 workers" in log.read_text()
        state = json.loads(_get(f"http://127.0.0.1:{webui}/json/"))
        assert state["status"] == "ALIVE" and state["aliveworkers"] == 2, state
        assert state["url"] == f"spark://127.0.0.1:{port}"
        assert f"Spark Master at spark://127.0.0.1:{port}" in _get(f"http://127.0.0.1:{webui}/").decode()
        addresses = _listening_addresses(proc.pid)
        assert any(a.endswith(f":{port}") for a in addresses) and any(a.endswith(f":{webui}") for a in addresses)
        assert all(_on_loopback(a) for a in addresses), addresses
        _stops_on_sigterm(proc)
    finally:
        _stop([proc])


def test_scripts_refuse_bad_arguments():
    for script, args, named in [
        ("dask-cluster.sh", ["--workers", "0"], "--workers"),
        ("dask-cluster.sh", ["--port"], "--port"),
        ("spark-standalone.sh", ["--webui-port", "x"], "--webui-port"),
        ("spark-standalone.sh", ["--bogus"], "--bogus"),
        ("spark-standalone.sh", ["--venv", "/nonexistent"], "--venv"),
    ]:
        proc = subprocess.run(["bash", str(SCRIPTS / script), *args], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2, (script, args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{script}: ") and named in lines[0], proc.stderr
