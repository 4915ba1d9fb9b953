"""A combined mesh as a job, on every launcher, with restarts (#55 item 7): a `dp_shard 2 x tp 2`
job whose rank is SIGKILLed mid-training is relaunched from its checkpoint and ends on the
uninterrupted run's weights, bit for bit, on local processes and on Dask workers; on Spark (a
barrier stage of 4 tasks) the same job ends on them too, and so does the `pp 2 x tp 2` one's.

Full tier only (`make test-all`, marker `slow`): 4-rank jobs (about 90 CPU-s in all), a Dask
cluster of 4 workers and a Spark JVM of 4 slots of their own (the session's have 2). The
quick tier keeps the meshes' match with single-process training (tests/test_mesh.py) and the
restart machinery on every launcher at 2 ranks (the killed-rank test of tests/test_checkpoints.py
is full tier too; its resume logic is the quick tier's tests/test_strategy_jobs.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from shardline.engines import DaskEngine, LocalEngine
from shardline.foundation.lease import process_alive, process_start_ticks
from shardline.training.checkpoints import sharded
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training
from shardline.training.launchers import announced

from .mlflow_store import env_without_store

pytestmark = pytest.mark.slow

# The mlp's Dense pair split by tp (hidden 64 -> 32), each half sharded over 2 data ranks.
MESH = dict(world_size=4, mesh={"dp_shard": 2, "tp": 2}, epochs=3, batch_size=128, hidden=[64, 32],
            checkpoint_every_steps=10, keep_checkpoints=100, max_restarts=2, timeout_s=120)


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory):
    """The dp_shard 2 x tp 2 job uninterrupted, on local processes."""
    cfg = TrainingConfig(launcher="local", checkpoint_dir=str(tmp_path_factory.mktemp("ref") / "ckpt"), **MESH)
    return run_training(cfg, TrackingConfig(experiment="mesh-ref", registered_model="mesh-ref"),
                        prepared.dataset_dir, LocalEngine())


@pytest.fixture(scope="module")
def four_dask_workers():
    from shardline.foundation.engine_config import DaskConfig
    from shardline.foundation.sessions import dask_client

    client = dask_client(DaskConfig(n_workers=4, memory_limit="2GiB"))
    yield client
    cluster = client.cluster
    client.close()
    cluster.close()


def _ranks_of(ckpt: Path, world_size: int) -> dict[int, tuple[int, str | None]]:
    """Each rank's process as it announced itself (ranks/rank-N.json), with its start time."""
    said = {rank: announced(str(ckpt / "ranks"), rank) for rank in range(world_size)}
    return {rank: (info["pid"], process_start_ticks(info["pid"])) for rank, info in said.items() if info}


def _kill_and_watch_the_relaunch(ckpt: Path, rank: int, world_size: int, done: threading.Event,
                                 seen: dict) -> None:
    """SIGKILL `rank` once a checkpoint exists; then, the moment every rank of the relaunch has
    announced itself, note which processes of the killed attempt still run. None may: a
    survivor sharing a process with the new group is how a relaunch mixes two meshes. (This
    test's one failure, [1, 8] against [2, 8] in materialise, was seen while Dask ranks still
    ran inside their workers' processes; each rank is a process of its own since.)"""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not done.is_set():
        first = _ranks_of(ckpt, world_size)
        if CheckpointStore(str(ckpt)).paths() and len(first) == world_size:
            os.kill(first[rank][0], signal.SIGKILL)
            seen["killed"], seen["first"] = first[rank][0], first
            break
        time.sleep(0.005)
    old = {pid for pid, _ in seen.get("first", {}).values()}
    while old and time.monotonic() < deadline and not done.is_set():
        now = _ranks_of(ckpt, world_size)
        if len(now) == world_size and not {pid for pid, _ in now.values()} & old:
            seen["alive"] = [pid for pid, start in seen["first"].values() if start and process_alive(pid, start)]
            return
        time.sleep(0.02)  # four files and their /proc entries a look: the ranks share two cores


@pytest.mark.parametrize("launcher", ["local", "dask"])
def test_a_killed_rank_of_a_dp_shard_x_tp_job_resumes_to_the_same_weights(prepared, reference, tmp_path, launcher,
                                                                         request):
    engine = DaskEngine(request.getfixturevalue("four_dask_workers")) if launcher == "dask" else LocalEngine()
    cfg = TrainingConfig(launcher=launcher, checkpoint_dir=str(tmp_path / "ckpt"), **MESH)
    done, seen = threading.Event(), {}
    watcher = threading.Thread(target=_kill_and_watch_the_relaunch, args=(tmp_path / "ckpt", 3, 4, done, seen))
    watcher.start()
    try:
        result = run_training(cfg, TrackingConfig(experiment=f"mesh-kill-{launcher}",
                                                  registered_model=f"mesh-kill-{launcher}"),
                              prepared.dataset_dir, engine)
    finally:
        done.set()
        watcher.join()
    assert "killed" in seen, "the rank was never killed"
    assert MlflowClient().get_run(result.run_id).data.metrics.get("restarts") == 1, "the kill missed training"
    # No rank of the killed attempt outlives it into the relaunch's group.
    assert seen.get("alive") == [], seen
    _equal(result.weights, reference.weights)


# Both Spark jobs in one process of their own, on one SparkSession of 4 slots: a second JVM
# and Python start would cost ~15 s and check nothing more (the CLI's Spark path is the
# quick tier's tests/test_quickstart.py).
SPARK_JOBS = """
import sys
import shardline
from shardline.foundation.engine_config import SparkConfig
from shardline.foundation.sessions import spark_session

config, jobs = sys.argv[1], sys.argv[2:]
spark = spark_session(SparkConfig(master="local[4,1]"))
try:
    for job in jobs:
        shardline.train(config, job.split(";"), spark=spark)
finally:
    spark.stop()
"""


def test_meshes_on_a_spark_barrier_stage_of_4_tasks(prepared, reference, tmp_path):
    """A process of its own (a JVM of 4 slots): the dp_shard x tp job ends on the local run's
    weights, and pp x tp trains too, its stages each split by tp."""
    config = tmp_path / "job.toml"
    config.write_text(
        f"[pipelines]\ndataset_dir = '{prepared.dataset_dir}'\n"
        "[training]\nlauncher = 'spark'\nworld_size = 4\nepochs = 3\nbatch_size = 128\nhidden = [64, 32]\n"
        "checkpoint_every_steps = 10\nkeep_checkpoints = 100\ntimeout_s = 120\n"
        f"[tracking]\ntracking_uri = 'sqlite:///{tmp_path / 'mlflow.db'}'\n"
    )
    jobs = {"dp_shard-tp": ["training.mesh.dp_shard=2", "training.mesh.tp=2"],
            "pp-tp": ["training.mesh.pp=2", "training.mesh.tp=2", "training.model=transformer",
                      "training.hidden=[16, 16]", "training.epochs=1"]}  # trains: 1 epoch says so
    args = [";".join([*mesh, f"training.checkpoint_dir='{tmp_path / name}'",
                      f"tracking.registered_model='mesh-spark-{name}'"]) for name, mesh in jobs.items()]
    env = env_without_store()
    proc = subprocess.run([sys.executable, "-c", SPARK_JOBS, str(config), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("✓ Training") == 2, proc.stderr[-3000:]
    # launchers agree bit for bit (CPU, one thread per rank)
    latest = CheckpointStore(str(tmp_path / "dp_shard-tp")).latest()
    _equal(sharded.read_weights(str(Path(latest))), reference.weights)
    assert CheckpointStore(str(tmp_path / "pp-tp")).latest() is not None
