"""A real S3-protocol server on loopback (moto_server), for `bench loader --storage s3` and the tests.

moto[server] is a test dependency: a benchmark without it says so in one line.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shardline.foundation import object_stores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    """Poll `ready()` until true; fail naming `what` (and its exit) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s")


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def moto_server_binary() -> str:
    here = Path(sys.executable).parent / "moto_server"
    found = str(here) if here.exists() else shutil.which("moto_server")
    if not found:
        raise RuntimeError("no moto_server to start an S3 server on loopback: pip install 'moto[server]'")
    return found


def start_moto(port: int, log: Path, env: dict | None = None) -> subprocess.Popen:
    """moto_server on 127.0.0.1:port in its own process group (stop_group stops it)."""
    proc = subprocess.Popen(
        [moto_server_binary(), "-H", "127.0.0.1", "-p", str(port)],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        wait_until(lambda: listening(port), 120, f"moto_server on port {port}", proc)
    except BaseException:
        stop_group(proc)
        raise
    return proc


def stop_group(proc: subprocess.Popen) -> None:
    """TERM the process group, then KILL what is left: servers spawn helpers that outlive them."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is gone; helpers in its group may not be
        except ProcessLookupError:
            pass
        return


def loopback_bucket(root: Path, progress=print) -> tuple[subprocess.Popen, str]:
    """Start moto_server for this run and point this process's AWS chain at it (child
    processes started from now on inherit it); (server, bucket URL). stop_loopback undoes it."""
    port = free_port()
    progress(f"starting an S3 server (moto) on 127.0.0.1:{port}")
    server = start_moto(port, root / "moto.log")
    os.environ.update({
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    })
    object_stores.forget_clients()  # clients made before now point elsewhere
    object_stores.s3_client().create_bucket(Bucket="shardline-bench")
    return server, "s3://shardline-bench"


def stop_loopback(server: subprocess.Popen, saved_env: dict) -> None:
    stop_group(server)
    os.environ.clear()
    os.environ.update(saved_env)
    object_stores.forget_clients()
