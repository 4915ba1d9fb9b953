"""`shardline ui`: the MLflow UI on the store shardline tracks to.

`mlflow ui --backend-store-uri http://…` fails (a server URL is not a store MLflow can
serve from; it raises UnsupportedModelRegistryStoreURIException), so the run summary
cannot just hand the URI to `mlflow ui`. A database store (the default SQLite file, or
postgresql://…) gets an `mlflow server` on it, bound to loopback unless told otherwise;
an MLflow server URL already is the UI, so it is checked and printed.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

from shardline.foundation.errors import ShardlineError, StorageError
from shardline.foundation.redact import redact
from shardline.training.config import TrackingConfig
from shardline.training.tracking import check_driver, health_request

SETTING = "tracking.tracking_uri"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def ui_hint(tracking_uri: str) -> str:
    """What the run summary tells a user to type (or open) to see the run."""
    if is_server(tracking_uri):
        return redact(tracking_uri)
    if tracking_uri == _absolute(TrackingConfig().resolved_uri()):
        return "shardline ui"  # what `shardline ui` opens from this folder, with this environment
    return f"shardline ui --set {SETTING}='{redact(tracking_uri)}'"


def _absolute(uri: str) -> str:
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{os.path.abspath(uri[len('sqlite:///'):])}"
    return uri


def check_server(uri: str, timeout_s: float = 10.0) -> None:
    """An MLflow server answers its /health, or one line saying it does not."""
    try:
        with urllib.request.urlopen(health_request(uri), timeout=timeout_s) as r:
            if r.status == 200:
                return
            reason = f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        reason = f"HTTP {e.code}"
    except (OSError, ValueError) as e:
        reason = str(getattr(e, "reason", e))
    raise StorageError(f"{SETTING} = {redact(uri)!r}: the MLflow server does not answer /health ({reason})")


def check_store(uri: str) -> None:
    """A SQLite store must exist: an `mlflow server` on a missing file would create an empty
    one and show no runs, which looks like lost work rather than a wrong folder."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_file():
            raise ShardlineError(
                f"{SETTING} = {redact(uri)!r}: no MLflow store there (nothing was tracked in {path.parent}); "
                f"run `shardline ui` from the folder you ran shardline in, or set {SETTING}"
            )


def check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ShardlineError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); "
                                 f"pick another with --port") from None


def server_command(host: str, port: int) -> list[str]:
    # The store URI goes in MLFLOW_BACKEND_STORE_URI, not on the command line: a database
    # URI's password would be readable by every user of the host in `ps`.
    return [sys.executable, "-m", "mlflow", "server",
            "--host", host, "--port", str(port), "--workers", "1"]


def serve(uri: str, host: str, port: int, say) -> None:
    """Check everything a user can get wrong, then become the MLflow server (exec): Ctrl-C
    and SIGTERM reach it directly, and nothing of shardline's is left to clean up."""
    if is_server(uri):
        check_server(uri)
        say(f"The MLflow server {redact(uri)} serves the UI itself: open {redact(uri)}")
        return

    check_store(uri)
    check_driver(uri)  # the server would say it in a traceback, after "ready"
    check_port(host, port)
    if host not in LOOPBACK:
        say(f"note: --host {host}: the MLflow UI has no login; anyone who reaches {host}:{port} "
            "can read and change every run in the store")
    env = dict(os.environ)
    # The server's job runner (huey consumers, for GenAI jobs the UI does not need) outlives
    # the server when only the server is signalled: leave it off unless the user asked for it.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    say(f"MLflow UI on {redact(uri)}: http://{host}:{port} (ready in ~15 s; Ctrl-C stops it)")
    sys.stdout.flush()
    sys.stderr.flush()
    env["MLFLOW_BACKEND_STORE_URI"] = uri
    cmd = server_command(host, port)
    os.execve(cmd[0], cmd, env)
