"""Bad Spark Connect input: one line, non-zero exit, before anything is written.

An unreachable or wrong endpoint, a server whose executors lack shardline's
environment, more ranks than the server has slots, a JVM setting a client
cannot change.

Full tier only (`make test-all`, marker `slow`): every case runs the CLI in a process of its own, or
needs a Spark Connect server (the session's, or one of its own whose executors lack the
environment).
"""

from __future__ import annotations

import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardline.training.launchers import free_port

from .conftest import REPO, absolute_paths, shardline
from .fixtures_connect import start_connect_server

pytestmark = pytest.mark.slow

QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"


def _errors(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


def _one_line_error(proc, code: int, tmp: Path) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = _errors(proc)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert not (tmp / "shardline-data").exists(), "something was written"
    return errors[0]


def test_unreachable_endpoint_is_one_line_in_seconds(tmp_path):
    port = free_port()  # nothing listens there
    # The client alone retries for about ten minutes; the timeout bounds a regression.
    proc = shardline(
        "prepare", str(QUICKSTART), "--set", f"spark.remote='sc://127.0.0.1:{port}'",
        *absolute_paths(tmp_path), cwd=tmp_path, timeout=180,
    )  # fmt: skip
    line = _one_line_error(proc, 1, tmp_path)
    assert line == (
        f"error: spark.remote sc://127.0.0.1:{port}: cannot reach a Spark Connect server at "
        f"127.0.0.1:{port} (Connection refused)"
    )


def test_a_port_that_is_not_spark_connect_is_one_line(tmp_path):
    """Something listens, but it does not speak Spark Connect: it closes every connection."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        stop = threading.Event()

        def refuse() -> None:
            srv.settimeout(0.2)
            while not stop.is_set():
                try:
                    srv.accept()[0].close()
                except TimeoutError:
                    pass

        t = threading.Thread(target=refuse, daemon=True)
        t.start()
        try:
            proc = shardline(
                "prepare", str(QUICKSTART), *absolute_paths(tmp_path), cwd=tmp_path, timeout=180,
                env={"SPARK_REMOTE": f"sc://127.0.0.1:{port}"},
            )  # fmt: skip
        finally:
            stop.set()
            t.join()
    line = _one_line_error(proc, 1, tmp_path)
    assert line.startswith(
        f"error: SPARK_REMOTE sc://127.0.0.1:{port}: 127.0.0.1:{port} does not answer as a Spark Connect server ("
    ), line


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://127.0.0.1:15002", "shardline runs on a Spark Connect server at sc://host:port"),
        ("sc://127.0.0.1:15002/path", "The path component '/path' must be empty"),
    ],
)
def test_a_malformed_remote_is_a_config_error(tmp_path, url, message):
    proc = shardline("score", str(QUICKSTART), "--model", "models:/x/1", "--set", f"spark.remote='{url}'",
                     cwd=tmp_path, timeout=180)
    line = _one_line_error(proc, 2, tmp_path)
    assert line.startswith(f"error: spark.remote '{url}': ") and message in line, line


def test_more_ranks_than_the_servers_slots_are_refused_before_training(connect_server, connect_cli, prepared,
                                                                      tmp_path):
    # One parameter server and 2 data ranks: the dataset's 2 shards pass the check made
    # before Spark starts; the 3 ranks do not fit the server's 2 slots.
    proc = connect_cli.run(
        "train", str(QUICKSTART), "--world-size", "3", "--set", f"spark.remote='{connect_server.url}'",
        *absolute_paths(tmp_path), "--set", f"pipelines.dataset_dir='{prepared.dataset_dir}'",
        "--set", "training.strategy='ps'", "--set", "training.ps.servers=1", "--set", "training.batch_size=256",
        "--set", f"training.checkpoint_dir='{tmp_path / 'ckpt'}'", cwd=tmp_path,
    )  # fmt: skip
    line = _one_line_error(proc, 1, tmp_path)
    assert line == (
        "error: training.world_size 3 is greater than the 2 task slots of Spark master local[2]: "
        "a barrier stage needs them all at once"
    )
    assert not (tmp_path / "ckpt").exists()


def test_a_jvm_setting_cannot_come_from_a_connect_client(connect_server, tmp_path):
    # A client of its own: the session-wide setting it sets first would stay in connect_cli's.
    proc = shardline(
        "prepare", str(QUICKSTART), "--set", f"spark.remote='{connect_server.url}'",
        "--set", "spark.conf={'spark.sql.shuffle.partitions' = '3', 'spark.ui.enabled' = 'true'}",
        *absolute_paths(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    line = _one_line_error(proc, 2, tmp_path)
    assert line.startswith("error: spark.conf.spark.ui.enabled: cannot be set from a Spark Connect client"), line
    assert line.endswith("set it where the Connect server is started (--conf on start-connect-server.sh)")


def _python_with_only(root: Path, packages: list[str]) -> str:
    """A venv of this interpreter's base Python that sees only `packages` of this venv."""
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python*/site-packages"))
    shared = root / "shared"
    shared.mkdir()
    here = Path(__import__("pyarrow").__file__).parent.parent
    for name in packages:
        for p in here.glob(f"{name}*"):  # the package and its .dist-info
            (shared / p.name).symlink_to(p)
    (site / "shared.pth").write_text(f"{shared}\n")
    return str(root / "bin" / "python")


@pytest.fixture(scope="module")
def servers_lacking_the_environment(tmp_path_factory):
    """Two Connect servers whose executors run a Python without shardline's dependencies:
    one without even pyarrow (Spark's Arrow UDFs cannot start), one with pyarrow only."""
    tmp = tmp_path_factory.mktemp("bare-servers")
    bare = _python_with_only(tmp / "bare", [])
    arrow = _python_with_only(tmp / "arrow", ["pyarrow"])
    with ThreadPoolExecutor(2) as pool:  # the two JVMs start side by side
        futures = {
            kind: pool.submit(start_connect_server, tmp / f"server-{kind}", py, f"shardline-{kind}")
            for kind, py in (("bare", bare), ("arrow", arrow))
        }
    servers, failures = {}, []
    for kind, f in futures.items():
        try:
            servers[kind] = f.result()
        except BaseException as e:
            failures.append(e)
    try:
        if failures:
            raise failures[0]
        yield {"bare": (servers["bare"], bare), "arrow": (servers["arrow"], arrow)}
    finally:
        for s in servers.values():
            s.stop()


@pytest.mark.parametrize("kind, missing", [("bare", "pyarrow"), ("arrow", "numpy, pandas, torch, mlflow, optuna")])
def test_executors_without_the_environment_are_named_before_anything_is_written(
    servers_lacking_the_environment, tmp_path, kind, missing
):
    server, python = servers_lacking_the_environment[kind]
    proc = shardline("prepare", str(QUICKSTART), "--set", f"spark.remote='{server.url}'", *absolute_paths(tmp_path),
                     cwd=tmp_path)
    line = _one_line_error(proc, 1, tmp_path)
    assert line.startswith(f"error: Spark executors cannot import {missing} ("), line
    if kind == "arrow":  # the probe ran and says which Python lacks them
        assert f"(their Python is {python} on " in line
    assert line.endswith(
        "start the Spark Connect server with PYSPARK_PYTHON set to a Python that has "
        "shardline's dependencies (its executors run that Python, not this one)"
    )
