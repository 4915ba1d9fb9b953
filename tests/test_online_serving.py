"""The registered model is a pyfunc that `mlflow models serve` serves over HTTP on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from pipelines.manifest import load_manifest
from training.launchers import free_port

from .serving_helpers import trained_model


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_mlflow_models_serve_scores_over_http(prepared, tracking_uri, tmp_path):
    result = trained_model(prepared)
    port = free_port()
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    # A file, not a pipe: a server that logs more than a pipe holds would block on it.
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [str(mlflow_cli), "models", "serve", "-m", result.model_uri, "--env-manager", "local",
             "-h", "127.0.0.1", "-p", str(port)],
            cwd=tmp_path,
            # As from an activated venv: the server execs `uvicorn` from PATH.
            env={
                **os.environ,
                "MLFLOW_TRACKING_URI": tracking_uri,
                "PATH": f"{mlflow_cli.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            },
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        # Generous: on a loaded machine the server's imports alone take minutes; the
        # loop ends as soon as it answers, or at once if it exits.
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=10).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "server did not answer /ping in 600 s"
                time.sleep(0.5)

        m = load_manifest(prepared.dataset_dir)
        shard = pq.read_table(Path(prepared.dataset_dir) / m.splits["test"].shards[0].path)
        x = np.stack(shard.column("features").to_numpy(zero_copy_only=False)[:8]).astype(np.float32)
        got = np.array(_post(f"http://127.0.0.1:{port}/invocations", {"inputs": x.tolist()})["predictions"])

        import mlflow

        mlflow.set_tracking_uri(tracking_uri)
        model = mlflow.pytorch.load_model(result.model_uri).eval()
        with torch.no_grad():
            want = model(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # never leave the server and its workers behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
