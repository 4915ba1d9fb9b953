"""Checkpoints resume exactly; a rank killed from outside is relaunched and ends on the same weights."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from shardline.engines import LocalEngine
from shardline.foundation import storage
from shardline.foundation.errors import DataError
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training

from .conftest import engine_for


def _cfg(tmp: Path, **kw) -> TrainingConfig:
    base = dict(
        launcher="local", world_size=2, epochs=4, batch_size=128, hidden=[64, 32],
        checkpoint_dir=str(tmp / "ckpt"), checkpoint_every_steps=10, keep_checkpoints=100,
        max_restarts=2, timeout_s=60,
    )
    return TrainingConfig(**{**base, **kw})


def _tracking(name: str) -> TrackingConfig:
    return TrackingConfig(experiment=f"ckpt-{name}", registered_model=f"ckpt-{name}")


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory):
    """An uninterrupted local run, and every checkpoint it wrote."""
    tmp = tmp_path_factory.mktemp("ref")
    result = run_training(_cfg(tmp), _tracking("ref"), prepared.dataset_dir, LocalEngine())
    return result, CheckpointStore(tmp / "ckpt").paths()


def test_checkpoints_are_plain_tensors_and_numbers(reference):
    _, paths = reference
    assert len(paths) > 5
    state = torch.load(paths[0], weights_only=True)  # no arbitrary unpickling
    assert {"sharded", "ranks", "global_step", "epoch", "step_in_epoch", "loader"} <= state.keys()
    # No weights in it: they and the optimizer state are in the DCP directory it names.
    assert "model" not in state and (Path(paths[0]).parent / state["sharded"] / ".metadata").exists()
    # Each rank's own resume state besides: its schedule, loader position and running sums of
    # the epoch's figures (its plain values), and its RNG states.
    assert [set(r) for r in state["ranks"]] == [{"model", "optimizer", "scheduler", "loader", "sums"}] * 2
    assert len(state["rng"]) == 2 and all(set(r) == {"cpu"} for r in state["rng"])
    # The loader's position is the checkpoint's: epoch and batches delivered in it.
    for p in paths:
        s = torch.load(p, weights_only=True)
        assert (s["loader"]["epoch"], s["loader"]["batches"]) == (s["epoch"], s["step_in_epoch"])


def test_resume_from_mid_epoch_checkpoint_gives_the_same_weights(prepared, reference, tmp_path):
    result, paths = reference
    mid = next(p for p in paths if torch.load(p, weights_only=True)["step_in_epoch"] not in (0,))
    (tmp_path / "ckpt").mkdir()
    shutil.copy(mid, tmp_path / "ckpt" / Path(mid).name)  # no pointer: latest() takes the newest
    dcp = torch.load(mid, weights_only=True)["sharded"]
    shutil.copytree(Path(mid).parent / dcp, tmp_path / "ckpt" / dcp)
    resumed = run_training(_cfg(tmp_path, resume=True), _tracking("resume"), prepared.dataset_dir, LocalEngine())
    _equal(resumed.weights, result.weights)
    # The resumed job continued the checkpoint's MLflow run.
    assert resumed.run_id == result.run_id


def test_checkpoint_of_another_config_says_what_differs(prepared, reference, tmp_path):
    _, paths = reference
    (tmp_path / "ckpt").mkdir()
    shutil.copy(paths[-1], tmp_path / "ckpt" / Path(paths[-1]).name)
    dcp = torch.load(paths[-1], weights_only=True)["sharded"]
    shutil.copytree(Path(paths[-1]).parent / dcp, tmp_path / "ckpt" / dcp)
    with pytest.raises(DataError, match=r"different run: hidden='\[64, 32\]' \(config has '\[32\]'\)"):
        run_training(_cfg(tmp_path, resume=True, hidden=[32]), _tracking("other"), prepared.dataset_dir, LocalEngine())


def test_a_checkpoint_without_its_dcp_directory_falls_back_to_the_previous_one(reference, tmp_path, capsys):
    _, paths = reference
    older, newest = Path(paths[-2]), Path(paths[-1])
    for head in (older, newest):
        shutil.copy(head, tmp_path / head.name)
    dcp = torch.load(older, weights_only=True)["sharded"]
    shutil.copytree(older.parent / dcp, tmp_path / dcp)  # the newest one's directory is lost
    found, state = CheckpointStore(str(tmp_path)).readable()
    assert Path(found).name == older.name and state["sharded"] == dcp
    said = capsys.readouterr().err
    assert f"{newest.name}: its DCP directory" in said and f"resuming from {older.name}" in said, said


def _kill_rank_after_first_checkpoint(ckpt_dir, rank: int, done: threading.Event, killed: list):
    """SIGKILL rank `rank` once a checkpoint exists in `ckpt_dir` (a path or any storage URL)."""
    ckpt_dir = str(ckpt_dir)
    info = storage.join(ckpt_dir, "ranks", f"rank-{rank}.json")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not done.is_set():
        if CheckpointStore(ckpt_dir).paths() and storage.exists(info):
            pid = json.loads(storage.read_bytes(info))["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.05 if storage.is_remote(ckpt_dir) else 0.005)


# How each launcher names the rank it lost, first in the restart line (#46): the signal
# that ended it (local; Dask, with its worker, which stays up: the rank is a process of its
# own), its Spark executor (the session is local[2,1]).
LOST = {
    "local": r"local training failed: rank 1 on \S+, pid {pid} was lost: killed by SIGKILL \(exit code -9\)",
    "dask": r"Dask training failed: rank 1 on \S+ \(worker tcp://\S+\), pid {pid} was lost: killed by SIGKILL "
            r"\(exit code -9\)",
    "spark": r"Spark barrier stage training failed: rank 1 on \S+ \(executor driver\), pid {pid} was lost: "
             r"Python worker exited unexpectedly \(crashed\)",
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "spark", "dask"])
def test_killed_rank_is_relaunched_and_ends_on_the_same_weights(
    prepared, reference, tmp_path, launcher, request, capfd
):
    """Full tier only (`make test-all`, marker `slow`): a kill test: a rank SIGKILLed mid-training and
    relaunched, on each launcher."""
    from mlflow.tracking import MlflowClient

    engine = engine_for(request, launcher)
    cfg = _cfg(tmp_path, launcher=launcher)
    done, killed = threading.Event(), []
    watcher = threading.Thread(
        target=_kill_rank_after_first_checkpoint, args=(tmp_path / "ckpt", 1, done, killed)
    )
    watcher.start()
    try:
        result = run_training(cfg, _tracking(f"kill-{launcher}"), prepared.dataset_dir, engine)
    finally:
        done.set()
        watcher.join()
    assert killed, "the rank was never killed"
    run = MlflowClient().get_run(result.run_id)
    assert run.data.metrics.get("restarts") == 1, "the kill did not land mid-training"
    _equal(result.weights, reference[0].weights)
    # The restart line leads with the rank that was lost, then the restart; no Java trace.
    err = capfd.readouterr().err
    restarts = [ln for ln in err.splitlines() if "restarting from" in ln]
    assert len(restarts) == 1 and re.match(r"\[shardline\] " + LOST[launcher].format(pid=killed[0]) + "; restarting from ",
                                           restarts[0]), restarts or err[-3000:]
    assert "ERROR Executor" not in err and "\tat org.apache" not in err, err[-3000:]
    # The resumed epoch's figures cover all its steps, as the uninterrupted run's do: its
    # running sums came back from the mid-epoch checkpoint.
    for metric in ("train_loss", "train_accuracy"):
        assert _by_epoch(result.run_id, metric) == pytest.approx(_by_epoch(reference[0].run_id, metric), rel=1e-9)


def _by_epoch(run_id: str, metric: str) -> list[float]:
    """The metric's last value logged at each epoch (a killed attempt may have logged one before)."""
    from mlflow.tracking import MlflowClient

    last = {m.step: m.value for m in sorted(MlflowClient().get_metric_history(run_id, metric), key=lambda m: m.timestamp)}
    return [last[k] for k in sorted(last)]


def test_one_optimizer_over_state_entries_named_like_module_dict_methods_is_paired():
    """A state's entries may be named anything (`items`, `keys`, `train`): one optimizer over
    several of its modules is paired with a ModuleDict of them, whose children's names must
    not be ModuleDict's own attributes."""
    from shardline.training.checkpoints.state import paired_module

    modules = {"items": torch.nn.Linear(2, 2), "keys": torch.nn.Linear(2, 1)}
    opt = torch.optim.SGD([*modules["items"].parameters(), *modules["keys"].parameters()], lr=0.1)
    paired = paired_module(opt, modules, "ctx.save")
    assert isinstance(paired, torch.nn.ModuleDict) and list(paired.values()) == list(modules.values())
