"""Faults end in a clear, safe state (#17 items 1 and 3), each placed for real.

- A driver SIGKILLed mid-training: its ranks die with it on every launcher (local: the
  parent-death signal and the driver's pid; Dask and Spark: the checkpoint directory's
  lease, which stops being renewed), and nothing more is written to the directory.
- A second job on a checkpoint directory in use: refused in one line naming the holder.
- Permanent errors end at once, never relaunched: a full disk under `checkpoint_dir`
  (a small tmpfs: the lease fits, a checkpoint does not), a read-only one (a read-only
  tmpfs, which stops root too).

Full tier only (`make test-all`, marker `slow`): drivers SIGKILLed or interrupted (Ctrl-C)
mid-training, and small or read-only tmpfs disks, which only root can mount.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from shardline.engines import LocalEngine
from shardline.foundation.errors import StorageError
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training
from shardline.training.launchers import TrainingFailed

from .conftest import REPO, engine_for, shardline_here
from .faults_helpers import (
    alive, error_lines, mounted_tmpfs, rank_pids, start_driver, stop_group, train_args, wait_for,
)

pytestmark = pytest.mark.slow


def _snapshot(ckpt: Path) -> dict[str, int]:
    return {str(p.relative_to(ckpt)): p.stat().st_mtime_ns for p in ckpt.rglob("*") if p.is_file()}


def _kill_driver_and_wait_for_ranks(driver, pids: list[int], within_s: float) -> None:
    os.kill(driver.pid, signal.SIGKILL)  # the driver alone, not its process group
    driver.wait(timeout=60)
    wait_for(lambda: not any(alive(p) for p in pids), f"ranks {pids} to die with their driver", within_s)


def test_local_ranks_die_with_their_driver_and_a_second_job_is_refused(prepared, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "first.log"
    driver = start_driver(train_args(prepared.dataset_dir, ckpt, **{"training.epochs": "400"}),
                          tmp_path / "first", log)
    try:
        pids = wait_for(lambda: rank_pids(ckpt), "the first checkpoint", proc=driver, log=log)
        # A second job on the same directory: one line naming the holder, before any engine.
        second = shardline_here(*train_args(prepared.dataset_dir, ckpt), cwd=tmp_path)
        assert second.returncode == 75, second.stderr[-2000:]
        assert error_lines(second.stderr) == [ln for ln in second.stderr.splitlines() if ln.strip()][-1:]
        line = error_lines(second.stderr)[0]
        assert f"training.checkpoint_dir {ckpt} is in use by shardline train" in line, line
        assert f"pid {driver.pid}," in line, line
        assert driver.poll() is None, "the second job disturbed the first"

        # The driver SIGKILLed: its ranks follow within seconds (parent-death signal, pid watch).
        _kill_driver_and_wait_for_ranks(driver, pids, within_s=60)
        before = _snapshot(ckpt)
        time.sleep(3)  # a surviving rank would checkpoint every 5 steps: several per second
        assert _snapshot(ckpt) == before, "something still writes the checkpoint directory"

        # A resume now takes the dead driver's lease over and finishes (one more epoch: the
        # epochs may change on resume when the user says so).
        epoch = torch.load(CheckpointStore(str(ckpt)).latest(), weights_only=True)["epoch"]
        resumed = shardline_here(*train_args(prepared.dataset_dir, ckpt, **{"training.epochs": str(epoch + 1)}),
                                 "--resume", "--allow-changed", "epochs", cwd=tmp_path / "first")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"took over the lease of {ckpt}/_lease.json" in resumed.stderr
        assert not (ckpt / "_lease.json").exists()  # released at the end
    finally:
        stop_group(driver)


@pytest.mark.slow
@pytest.mark.cluster
def test_dask_ranks_stop_when_their_driver_stops_renewing_the_lease(prepared, dask_cli_cluster, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "driver.log"
    ttl = 6
    args = train_args(prepared.dataset_dir, ckpt, **{
        "training.launcher": "'dask'", "dask.address": f"'{dask_cli_cluster.address}'",
        "training.epochs": "400", "training.lease_ttl_s": str(ttl),
    })
    driver = start_driver(args, tmp_path / "run", log)
    try:
        pids = wait_for(lambda: rank_pids(ckpt), "the first checkpoint", proc=driver, log=log)
        # A Dask task cannot be cancelled once it runs: only the lease tells the ranks.
        _kill_driver_and_wait_for_ranks(driver, pids, within_s=ttl * 3 + 30)
        before = _snapshot(ckpt)
        time.sleep(3)
        assert _snapshot(ckpt) == before, "something still writes the checkpoint directory"
    finally:
        stop_group(driver)


def _cfg(ckpt: Path, **kw) -> TrainingConfig:
    base = dict(launcher="local", world_size=2, epochs=2, batch_size=256, hidden=[64, 32],
                checkpoint_dir=str(ckpt), checkpoint_every_steps=5, max_restarts=2, timeout_s=60)
    return TrainingConfig(**{**base, **kw})


@pytest.mark.parametrize("launcher", ["local", "spark"])
def test_a_full_disk_ends_at_once_naming_rank_host_path_and_cause(prepared, tmp_path, capfd, launcher, request):
    engine = engine_for(request, launcher)
    ckpt = tmp_path / "ckpt"
    # 32 KiB: the lease and the ranks' notes fit, a checkpoint (~100 KiB) does not.
    with mounted_tmpfs(ckpt, "size=32k"):
        with pytest.raises(TrainingFailed) as failed:
            run_training(_cfg(ckpt, launcher=launcher), TrackingConfig(experiment=f"full-{launcher}"),
                         prepared.dataset_dir, engine)
    message = str(failed.value)
    assert failed.value.permanent and "\n" not in message
    # Every rank writes its own part: whichever met the full disk first is named.
    assert re.search(r"rank \d on ", message) and "No space left on device" in message, message
    assert f"training.checkpoint_dir: cannot write {ckpt}/ckpt-" in message, message
    err = capfd.readouterr().err
    assert "restarting from" not in err, "a full disk was retried"
    if launcher == "local":
        assert "Traceback" not in err  # the rank's one line reached the driver; no trace for it


def test_a_read_only_checkpoint_dir_ends_at_once_in_one_line(prepared, tmp_path):
    ckpt = tmp_path / "ckpt"
    with mounted_tmpfs(ckpt, "ro"):
        with pytest.raises(StorageError, match=rf"training.checkpoint_dir {ckpt}: cannot write there "
                                               r"\(Read-only file system\)"):
            run_training(_cfg(ckpt), TrackingConfig(experiment="ro"), prepared.dataset_dir, LocalEngine())
        proc = shardline_here(*train_args(prepared.dataset_dir, ckpt), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert error_lines(proc.stderr) == [
        f"error: training.checkpoint_dir: {ckpt}: read-only file system (cannot write in {ckpt})"
    ], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["prepare", "score"])
def test_read_only_outputs_of_prepare_and_score_end_in_one_line(prepared, tmp_path, command):
    out = tmp_path / "out"
    with mounted_tmpfs(out, "ro"):
        if command == "prepare":
            args = ["prepare", str(train_args("x", out)[1]), "--set", f"pipelines.dataset_dir='{out}'",
                    "--set", f"pipelines.source.path='{tmp_path / 'raw'}'"]
            setting = "pipelines.dataset_dir"
        else:
            args = ["score", str(train_args("x", out)[1]), "--model", "models:/faults/1",
                    "--input", prepared.dataset_dir, "--output", str(out)]
            setting = "serving.output_dir"
        proc = shardline_here(*args, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and setting in lines[0] and str(out) in lines[0], proc.stderr[-2000:]
    assert "read-only file system" in lines[0] and "Traceback" not in proc.stderr
    assert "Starting" not in proc.stderr  # refused before an engine started


@pytest.mark.parametrize("signalled", ["terminal", pytest.param("driver", marks=pytest.mark.slow)])
def test_ctrl_c_on_classic_spark_stops_the_ranks_and_says_one_line(prepared, tmp_path, monkeypatch, signalled):
    """SIGINT to `shardline train` on a classic local Spark: "aborted", exit 130, no
    traceback (PySpark's own handler re-entered the Py4J call the driver waited in:
    "RuntimeError: reentrant call"), and the ranks' job cancelled, so they stop at once:
    `LATEST` moves at most once after the signal (a checkpoint being written may complete).
    From a terminal the whole foreground group gets it (the JVM too); `kill -INT` the driver
    alone, whose cancelled Spark tasks took seconds to end while the ranks committed
    checkpoint after checkpoint (#46)."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "driver.log"
    # The driver's JVM forks its Python workers (the ranks) from a daemon that imported torch
    # and MLflow once (tests/preloaded_spark_daemon.py), not each rank importing them anew:
    # Spark's own setting, given as a user gives spark-submit one.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS",
                       "--conf spark.python.daemon.module=tests.preloaded_spark_daemon pyspark-shell")
    driver = start_driver(train_args(prepared.dataset_dir, ckpt, **{"training.launcher": "'spark'",
                                                                     "training.epochs": "400"}),
                          tmp_path / "run", log)
    store = CheckpointStore(str(ckpt))
    try:
        pids = wait_for(lambda: rank_pids(ckpt), "the first checkpoint", proc=driver, log=log)
        before = {Path(p).name for p in store.paths()}
        if signalled == "terminal":
            os.killpg(driver.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        else:
            os.kill(driver.pid, signal.SIGINT)  # `kill -INT <driver>`: the JVM and the ranks are not signalled
        code = driver.wait(timeout=300)
        out = log.read_text(errors="replace")
        assert code == 130, out[-3000:]
        lines = out.splitlines()
        assert "aborted" in lines, out[-3000:]
        # The ranks' job was cancelled and its tasks ended before the driver said so: no
        # rank trains on to print an epoch line after it.
        assert not [ln for ln in lines[lines.index("aborted"):] if "[shardline] epoch" in ln], out[-3000:]
        assert "Traceback" not in out and "reentrant" not in out and "Exception in thread" not in out, out[-3000:]
        # Checkpoints every 5 steps: several a second while the ranks still ran.
        at_exit = {Path(p).name for p in store.paths()}
        assert len(at_exit - before) <= 1, f"committed after the signal: {sorted(at_exit - before)}"
        wait_for(lambda: not any(alive(p) for p in pids), f"ranks {pids} to stop", within_s=120)
        assert {Path(p).name for p in store.paths()} == at_exit, "a checkpoint was written after the job ended"
    finally:
        stop_group(driver)
