"""Shared by the serving tests: one trained model per session, raw input files, a flaky model,
`mlflow models serve` of a registered model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

_TRAINED: dict[str, object] = {}
TRAINING = dict(launcher="local", world_size=1, epochs=1, batch_size=256)  # the session's model's


def trained_model(prepared) -> object:
    """A model registered as `serving-test`, trained once per session (1 rank, 1 epoch)."""
    if "result" not in _TRAINED:
        from shardline.training.config import TrackingConfig, TrainingConfig
        from shardline.training.job import run_training

        _TRAINED["result"] = run_training(
            TrainingConfig(**TRAINING),
            TrackingConfig(experiment="serving-test", registered_model="serving-test"),
            prepared.dataset_dir,
        )
    return _TRAINED["result"]


def raw_table(prepared) -> pa.Table:
    files = sorted(Path(prepared.source.path).rglob("*.parquet"))
    return pa.concat_tables(pq.read_table(f) for f in files).sort_by("key")


def write_raw(table: pa.Table, directory: Path, files: int, start: int = 0) -> list[Path]:
    """`table` cut into `files` Parquet files named part-<start+i>.parquet."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, idx in enumerate(np.array_split(np.arange(table.num_rows), files)):
        p = directory / f"part-{start + i:04d}.parquet"
        pq.write_table(table.take(pa.array(idx)), p)
        paths.append(p)
    return paths


def version_dir(output_dir) -> Path:
    """The one model version directory of an output a test scored with one version."""
    dirs = sorted(Path(output_dir).glob("model=*/version=*"))
    assert len(dirs) == 1, dirs
    return dirs[0]


def committed_files(out) -> list[str]:
    """The committed score files of every version in the output (the ledgers name them)."""
    from shardline.foundation import storage
    from shardline.serving.ledger import all_scores

    return sorted(storage.join(s.dir, e["output"]) for s in all_scores(out) for e in s.entries.values())


def read_scores(output_dir) -> pa.Table:
    return pa.concat_tables(pq.read_table(f) for f in committed_files(output_dir))


class FlakyModel(torch.nn.Module):
    """Fails its first call in the whole test (a marker file records it), then works.

    It stands in for any fault in a task (a lost executor, an OOM) without
    mocking the engine: the task really fails and the engine really retries.
    """

    def __init__(self, inner: torch.nn.Module, marker: str):
        super().__init__()
        self.inner = inner
        self.marker = marker

    def forward(self, x):
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return self.inner(x)
        os.close(fd)
        raise RuntimeError("injected failure: first call of FlakyModel")


def register_wrapped(prepared, tracking_uri: str, name: str, wrap) -> str:
    """Register `wrap(trained model)` (a fault-injecting model) in the training run, so raw
    input finds its dataset; its pinned models:/ URI."""
    import mlflow

    base = trained_model(prepared)
    mlflow.set_tracking_uri(tracking_uri)
    from shardline.training.models.registered import load_torch_model

    inner = load_torch_model(base.model_uri)
    # Into the training run's experiment: the active one is whichever an earlier test set,
    # and MLflow refuses to reopen a run under another experiment.
    mlflow.set_experiment(experiment_id=mlflow.get_run(base.run_id).info.experiment_id)
    with mlflow.start_run(run_id=base.run_id):
        info = mlflow.pytorch.log_model(
            wrap(inner),
            name=f"wrapped-{name}",
            pip_requirements=["torch"],
            serialization_format="pickle",
            registered_model_name=name,
        )
    return f"models:/{name}/{info.registered_model_version}"


def register_flaky(prepared, tracking_uri: str, marker: Path, name: str) -> str:
    return register_wrapped(prepared, tracking_uri, name, lambda inner: FlakyModel(inner, str(marker)))


def promo_model(prepared, tracking_uri: str) -> str:
    """Registered model `promo` with versions 1 and 2 (the same weights: where scores land
    is the point, not their values), registered once per session, as shardline registers
    its own models (no pickle: scoring needs no serving.allow_pickled_models)."""
    if "promo" not in _TRAINED:
        import mlflow

        from shardline.pipelines.manifest import load_manifest
        from shardline.training.config import TrainingConfig
        from shardline.training.models.registered import load_torch_model, log_raw_model

        base = trained_model(prepared)
        mlflow.set_tracking_uri(tracking_uri)
        inner = load_torch_model(base.model_uri)
        mlflow.set_experiment(experiment_id=mlflow.get_run(base.run_id).info.experiment_id)
        with mlflow.start_run(run_id=base.run_id):  # the training run's: raw input finds its dataset
            for _ in range(2):
                log_raw_model(inner, load_manifest(prepared.dataset_dir), TrainingConfig(**TRAINING), "promo",
                              pip_requirements=["torch"])
        _TRAINED["promo"] = "promo"
    return _TRAINED["promo"]


@contextmanager
def served(model_uri: str, tracking_uri: str, folder: Path):
    """`mlflow models serve` of `model_uri` on a free loopback port, run in `folder` (its log
    there): yields the server's base URL once it answers /ping; stopped, its workers too,
    however the block ends."""
    from shardline.training.launchers import free_port

    port = free_port()
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    log_path = folder / "serve.log"
    # A file, not a pipe: a server that logs more than a pipe holds would block on it.
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(mlflow_cli), "models", "serve", "-m", model_uri, "--env-manager", "local",
             "-h", "127.0.0.1", "-p", str(port)],
            cwd=folder,
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
                assert proc.poll() is None, log_path.read_text()[-2000:]
                assert time.monotonic() < deadline, "server did not answer /ping in 600 s"
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # never leave the server and its workers behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def score(engine_name, spark_or_client, model_uri, tracking_uri, input_path, output_dir, *, split="test",
          incremental=False, backfill="new", force=False, batch_size=4096, threads_per_task=1, lease=None,
          user_code=(), allow_pickled=False, output_format="parquet"):
    """A scoring job on a given engine handle: serving.score's plan, then execute (what
    shardline.score does after its checks and leases), for tests that drive the engine
    layer directly. allow_pickled: serving.allow_pickled_models (the fault-injecting
    wrappers register_wrapped logs are pickled models)."""
    from shardline.serving.score import execute, plan

    p = plan(model_uri, tracking_uri, input_path, output_dir, split=split, incremental=incremental,
             backfill=backfill, force=force, allow_pickled=allow_pickled, output_format=output_format)
    return execute(p, engine_name, spark_or_client, batch_size=batch_size, threads_per_task=threads_per_task,
                   lease=lease, user_code=user_code)
