"""Session fixtures: a real S3-protocol server (moto_server) and an MLflow tracking server whose
artifacts go to it (proxied), both on loopback, both started on first use and stopped at the end.

The AWS variables are set when this module is imported (conftest's `pytest_plugins`
imports it before any test runs): Spark's and Dask's worker processes inherit the
environment when they start, which may be before the first S3 fixture runs. They
point at a server that exists only once `s3` has started it; nothing else in the
suite talks to S3.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from shardline.benchmarks.s3_server import free_port, start_moto, stop_group, wait_until

__all__ = ["free_port", "start_moto", "stop_group", "wait_until"]  # the tests take them from here


S3_PORT = free_port()
S3_ENDPOINT = f"http://127.0.0.1:{S3_PORT}"
AWS_ENV = {
    "AWS_ENDPOINT_URL": S3_ENDPOINT,
    "AWS_ACCESS_KEY_ID": "shardline-test",
    "AWS_SECRET_ACCESS_KEY": "shardline-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}
os.environ.update(AWS_ENV)
# No ~/.aws of the machine's user may change what the tests see.
os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull

# For every `mlflow server` a test starts: no job runner. MLflow 3 starts one beside each
# server (a huey consumer and 8 more processes, for GenAI jobs tracking never uses); it
# doubled a server's start. (`shardline ui` leaves it off too; tests/multihost_bed.py, which
# must not import this module's environment, says the same for its own server.)
NO_JOB_RUNNER = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

_BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> str:
    """The S3 endpoint URL; the process environment already points boto3 and pyarrow at it."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    proc = start_moto(S3_PORT, log)
    yield S3_ENDPOINT
    stop_group(proc)


def new_bucket(prefix: str = "t") -> str:
    """A fresh, empty bucket: s3://<prefix>-<random>."""
    from shardline.foundation.object_stores import s3_client

    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    s3_client().create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture
def bucket(s3) -> str:
    return new_bucket()


def s3_keys(url: str) -> list[str]:
    """Every key under an s3:// URL, relative to it."""
    from shardline.foundation import storage

    return [k[len(url) + 1 :] for k in storage.find_files(url)]


@pytest.fixture(scope="session")
def mlflow_server(s3, tmp_path_factory) -> str:
    """An MLflow tracking server with proxied artifacts in s3://mlflow-artifacts/mlflow.

    The server has the AWS variables; its clients (ranks included) never need them:
    they upload artifacts to the server, which writes them to the bucket.
    """
    from shardline.foundation.object_stores import s3_client

    s3_client().create_bucket(Bucket="mlflow-artifacts")
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = {**os.environ, **AWS_ENV, "MLFLOW_S3_ENDPOINT_URL": S3_ENDPOINT, **NO_JOB_RUNNER}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(
        [
            str(_BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", "s3://mlflow-artifacts/mlflow",
        ],
        cwd=root, env=env, stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200

    try:
        wait_until(healthy, 300, "mlflow server", proc)
    except BaseException:
        stop_group(proc)
        print((root / "server.log").read_text()[-3000:], file=sys.stderr)
        raise
    yield url
    stop_group(proc)
    shutil.rmtree(root / "mlartifacts", ignore_errors=True)
