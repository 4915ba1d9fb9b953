"""A Dask CLI cluster on a loaded machine (#53 item 3): a lost rank is relaunched and the job
ends on the weights of an uninterrupted one, and the cluster runs the next job as it is.

Before, a rank ran inside its Dask worker's process: killing it killed the worker, the
relaunch waited for the nanny's new worker to import torch while rank 0's TCPStore waited
for it (`DistStoreError: ... 1/2 clients joined` after 301 s, twice), and the next job on
the same cluster failed its rendezvous on process-group state a failed rank had left in a
worker process. Now each rank is a process forked from its worker's rank server
(shardline.engines.dask.launch): killed, it leaves its worker up; a worker killed with it comes
back and is made ready before any rank waits on it.

Full tier only (marker `cluster`: the session's Dask CLI cluster; `slow`: it kills processes
and loads the machine with two CPU hogs). ~3-5 minutes on the 2-core machine beside the hogs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest
import torch

from shardline.engines import DaskEngine
from shardline.foundation.engine_config import DaskConfig
from shardline.foundation.sessions import dask_client
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training

from .faults_helpers import cpu_hogs, parent_pid

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def _cfg(ckpt, **kw) -> TrainingConfig:
    base = dict(launcher="dask", world_size=2, epochs=4, batch_size=128, hidden=[64, 32], checkpoint_dir=str(ckpt),
                checkpoint_every_steps=10, keep_checkpoints=100, max_restarts=2, timeout_s=300)
    return TrainingConfig(**{**base, **kw})


def _rank_pid(ckpt, rank: int) -> int | None:
    try:
        return json.loads((ckpt / "ranks" / f"rank-{rank}.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):  # not written yet, or being rewritten
        return None


def _worker_of(client, pid: int) -> int:
    """The Dask worker process that runs process `pid` (itself, or its ancestor)."""
    workers = set(client.run(os.getpid).values())
    while pid not in workers:
        pid = parent_pid(pid)
        assert pid > 1, f"no Dask worker of {workers} runs the rank"
    return pid


def _kill_twice(client, ckpt, done: threading.Event, killed: list) -> None:
    """Once a checkpoint exists, SIGKILL rank 1's process; once its relaunch has written a
    checkpoint of its own, SIGKILL the Dask worker that runs rank 1 (its rank with it)."""
    store = CheckpointStore(str(ckpt))
    while not done.is_set():
        pid = _rank_pid(ckpt, 1)
        if pid and store.paths():
            os.kill(pid, signal.SIGKILL)
            killed.append(("rank", pid, len(store.paths())))
            break
        time.sleep(0.01)
    while not done.is_set():
        pid, seen = _rank_pid(ckpt, 1), killed[0][2]
        if pid and pid != killed[0][1] and len(store.paths()) > seen:
            worker = _worker_of(client, pid)
            os.kill(worker, signal.SIGKILL)
            killed.append(("worker", pid, worker))
            return
        time.sleep(0.01)


def test_a_killed_rank_and_worker_under_load_resume_and_the_next_job_runs(prepared, dask_cli_cluster, tmp_path,
                                                                          capfd):
    client = dask_client(DaskConfig(address=dask_cli_cluster.address))  # ships shardline's own code
    done, killed = threading.Event(), []
    try:
        with cpu_hogs(2):
            killer = threading.Thread(target=_kill_twice, args=(client, tmp_path / "ckpt", done, killed), daemon=True)
            killer.start()
            try:
                resumed = run_training(_cfg(tmp_path / "ckpt"), TrackingConfig(experiment="dask-load-kill"),
                                       prepared.dataset_dir, DaskEngine(client))
            finally:
                done.set()
                killer.join()
            err = capfd.readouterr().err
            # The same cluster, as the kills left it, runs the next job: the uninterrupted reference.
            client.wait_for_workers(2, timeout=300)
            again = run_training(_cfg(tmp_path / "ckpt-again"), TrackingConfig(experiment="dask-load-again"),
                                 prepared.dataset_dir, DaskEngine(client))

        # No rank ran in a worker's process (none keeps a process group, a store or their
        # threads): each announced a process of its own.
        workers = set(client.run(os.getpid).values())
    finally:
        client.close()
    assert [k[0] for k in killed] == ["rank", "worker"], killed
    assert {_rank_pid(tmp_path / "ckpt-again", r) for r in (0, 1)}.isdisjoint(workers), workers
    restarts = [ln for ln in err.splitlines() if "restarting from" in ln]
    # Each restart line leads with the rank that was lost, as its worker saw it.
    assert len(restarts) == 2, err[-3000:]
    assert re.match(rf"\[shardline\] Dask training failed: rank 1 on \S+ \(worker tcp://\S+\), pid {killed[0][1]} "
                    r"was lost: killed by SIGKILL \(exit code -9\); restarting from ckpt-", restarts[0]), restarts[0]
    assert re.match(rf"\[shardline\] Dask training failed: rank 1 on \S+ \(worker tcp://\S+\), pid {killed[1][1]} "
                    r"was lost: its Dask worker left the cluster; restarting from ckpt-", restarts[1]), restarts[1]
    assert resumed.weights.keys() == again.weights.keys()
    for name in again.weights:
        assert torch.equal(resumed.weights[name], again.weights[name]), name
