"""shardline on a real Spark Connect server: prepare, train every strategy, sweep, score,
and a killed rank that resumes. Each step is the CLI a user runs, as a Connect client: the
session's one client process (`connect_cli`), so the commands share a session as a
notebook user's would."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from shardline.engines import LocalEngine
from shardline.pipelines.manifest import load_manifest
from shardline.training.checkpoints import sharded
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training

from .conftest import REPO, absolute_paths

QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"


def sets(section: str, values: dict) -> list[str]:
    """`--set section.field=value` arguments, values written as TOML."""
    out = []
    for k, v in values.items():
        out += ["--set", f"{section}.{k}={json.dumps(v) if not isinstance(v, bool) else str(v).lower()}"]
    return out


@pytest.fixture(scope="module")
def connect_dataset(connect_server, connect_cli, prepared, tmp_path_factory) -> Path:
    """The session's small dataset (conftest's `prepared`), prepared again on Connect,
    the server named by the standard SPARK_REMOTE variable."""
    tmp = tmp_path_factory.mktemp("connect-prepare")
    layout = prepared.layout.model_dump(include={"world_size"})
    synthetic = prepared.source.synthetic.model_dump(include={"rows", "partitions"})
    proc = connect_cli.run(
        "prepare", str(QUICKSTART),
        *sets("pipelines", {"dataset_dir": str(tmp / "dataset")}),
        *sets("pipelines.source", {"path": str(tmp / "raw")}),
        *sets("pipelines.source.synthetic", synthetic), *sets("pipelines.layout", layout),
        cwd=tmp, env={"SPARK_REMOTE": connect_server.url},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + connect_server.log_tail()
    assert f"Spark Connect {connect_server.url} (master local[2])" in proc.stderr
    return tmp / "dataset"


def test_prepare_on_connect_writes_the_same_dataset_as_classic_spark(connect_dataset, prepared):
    ours, classic = load_manifest(str(connect_dataset)), load_manifest(prepared.dataset_dir)
    assert ours.splits.keys() == classic.splits.keys() == {"train", "val", "test"}
    for split in classic.splits:
        assert [(s.rows, s.sha256) for s in ours.splits[split].shards] == [
            (s.rows, s.sha256) for s in classic.splits[split].shards
        ], split


def test_run_on_connect_prepares_trains_and_scores(connect_server, connect_cli, tmp_path):
    proc = connect_cli.run(
        "run", str(QUICKSTART), "--set", f"spark.remote='{connect_server.url}'", *absolute_paths(tmp_path),
        *sets("pipelines.source.synthetic", {"rows": 4000}), *sets("training", {"epochs": 1}),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + connect_server.log_tail()
    # The executors ran the server's Python and imported shardline from the shipped zip.
    assert f"executors: Python 3.{sys.version_info.minor} ({sys.executable}" in proc.stderr
    # The stages' unit counts came from the server's tasks to this console.
    assert re.search(r"\[shardline\] prepare pass 1: (\d+)/\1 units read", proc.stderr), proc.stderr[-3000:]
    assert re.search(r"\[shardline\] score: (\d+)/\1 units scored", proc.stderr), proc.stderr[-3000:]
    test_rows = load_manifest(str(tmp_path / "shardline-data/quickstart/dataset")).splits["test"].rows
    import pyarrow.parquet as pq

    scores = pq.read_table(tmp_path / "shardline-data/quickstart/scores")
    assert scores.num_rows == test_rows
    assert set(scores.column("model_version").to_pylist()) == {"1"}


@pytest.mark.parametrize(
    "strategy, extra",
    [("ps", {"ps.servers": 1}), ("pipeline", {"pipeline.micro_batches": 4}), ("tensor", {})],
)
def test_every_strategy_trains_on_connect(connect_server, connect_cli, connect_dataset, tmp_path, strategy, extra):
    proc = connect_cli.run(
        "train", str(QUICKSTART), "--set", f"spark.remote='{connect_server.url}'",
        *sets("pipelines", {"dataset_dir": str(connect_dataset)}),
        *sets("training", {"strategy": strategy, "epochs": 1, "batch_size": 256,
                           "checkpoint_dir": str(tmp_path / "ckpt"), **extra}),
        *sets("tracking", {"experiment": f"connect-{strategy}", "registered_model": f"connect-{strategy}"}),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + connect_server.log_tail()
    assert f"model models:/connect-{strategy}/1" in proc.stderr
    assert "val_accuracy" in proc.stderr
    # The ranks run in the Connect server's executors, whose stderr is the server's log:
    # the epoch line reached this console through the driver's progress listener.
    assert "[shardline] epoch 1/1: " in proc.stderr, proc.stderr[-2000:]


def test_sweep_on_connect_runs_two_trials_at_once(connect_server, connect_cli, connect_dataset, tmp_path):
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(f"""
[spark]
remote = "{connect_server.url}"

[pipelines]
dataset_dir = "{connect_dataset}"

[training]
epochs = 1
batch_size = 128
checkpoint_dir = "{tmp_path / 'ckpt'}"

[tracking]
experiment = "connect-sweep"
registered_model = "connect-sweep"

[sweep]
engine = "spark"
pruner = "none"
trials = 2
parallel = 2
world_size = 1

[sweep.space.lr]
type = "float"
low = 1e-3
high = 3e-2
log = true
""")
    proc = connect_cli.run("sweep", str(cfg), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:] + connect_server.log_tail()
    assert "2 complete, 0 pruned, 0 failed (2 run now)" in proc.stdout
    assert "models:/connect-sweep@best" in proc.stdout


def _kill_rank_after_first_checkpoint(ckpt: Path, rank: int, done: threading.Event, killed: list) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not done.is_set():
        info = ckpt / "ranks" / f"rank-{rank}.json"
        if CheckpointStore(ckpt).paths() and info.exists():
            pid = json.loads(info.read_text())["pid"]
            os.kill(pid, signal.SIGKILL)  # the rank's Python worker, under the Connect server
            killed.append(pid)
            return
        time.sleep(0.005)


def test_killed_rank_on_connect_is_relaunched_and_ends_on_the_same_weights(
    connect_server, connect_cli, connect_dataset, tmp_path
):
    settings = dict(
        world_size=2, epochs=4, batch_size=128, hidden=[64, 32], checkpoint_every_steps=10,
        keep_checkpoints=100, max_restarts=2, timeout_s=60,
    )
    # The reference: the same training, uninterrupted, on local processes (launchers agree
    # bit for bit: CPU, one thread per rank; see test_checkpoints).
    ref = run_training(
        TrainingConfig(launcher="local", checkpoint_dir=str(tmp_path / "ref"), **settings),
        TrackingConfig(experiment="connect-kill-ref", registered_model="connect-kill-ref"),
        str(connect_dataset), LocalEngine(),
    )
    ckpt = tmp_path / "ckpt"
    done, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_rank_after_first_checkpoint, args=(ckpt, 1, done, killed))
    watcher.start()
    try:
        proc = connect_cli.run(
            "train", str(QUICKSTART), "--set", f"spark.remote='{connect_server.url}'",
            *sets("pipelines", {"dataset_dir": str(connect_dataset)}),
            *sets("training", {**settings, "launcher": "spark", "checkpoint_dir": str(ckpt)}),
            *sets("tracking", {"experiment": "connect-kill", "registered_model": "connect-kill"}),
            cwd=tmp_path,
        )  # fmt: skip
    finally:
        done.set()
        watcher.join()
    assert killed, "the rank was never killed"
    assert proc.returncode == 0, proc.stderr[-3000:] + connect_server.log_tail()
    assert "Spark barrier stage training failed" in proc.stderr and "restarting from" in proc.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = re.search(r"run ([0-9a-f]{32}); model", proc.stderr)[1]
    assert client.get_run(run_id).data.metrics.get("restarts") == 1, "the kill did not land mid-training"
    final = torch.load(CheckpointStore(ckpt).paths()[-1], weights_only=True)
    assert final["global_step"] == torch.load(
        CheckpointStore(tmp_path / "ref").paths()[-1], weights_only=True
    )["global_step"]
    weights = sharded.read_weights(CheckpointStore(ckpt).paths()[-1])
    assert weights.keys() == ref.weights.keys()
    for k in ref.weights:
        assert torch.equal(weights[k], ref.weights[k]), k


def test_no_rdd_or_spark_context_in_shardline():
    """Spark Connect has neither: every Spark call shardline makes must run on both."""
    import io
    import tokenize

    names = {"sparkContext", "SparkContext", "rdd", "parallelize", "mapPartitions", "addPyFile",
             "setJobDescription", "setLogLevel", "defaultParallelism"}
    # A line may use them only in a branch Connect never reaches, said on the line itself
    # ("# classic only: ..."), in a file that tells the two apart (is_connect).
    # `parallelize` is also training.strategies' module of that name: as Spark's, only a call
    # of an attribute (`sc.parallelize(...)`) counts.
    calls_only = {"parallelize"}
    hits = []
    for pkg in ("shardline", "pipelines", "training", "serving", "jobs", "benchmarks"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            text = f.read_text()
            lines = text.splitlines()
            tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
            for i, t in enumerate(tokens):
                if t.type != tokenize.NAME or t.string not in names:
                    continue
                if t.string in calls_only and not (tokens[i - 1].string == "." and tokens[i + 1].string == "("):
                    continue
                if "# classic only:" in lines[t.start[0] - 1] and "is_connect(" in text:
                    continue
                hits.append(f"{f.relative_to(REPO)}:{t.start[0]}: {t.string}")
    assert not hits, "\n".join(hits)
