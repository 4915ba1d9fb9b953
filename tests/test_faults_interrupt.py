"""Ctrl-C on a loaded machine ends a training command in one line (#53 item 8): "aborted",
exit 130, the ranks stopped, and nothing else on the console.

- Dask: the driver waited in `client.gather`; interrupted there, the gather's per-future
  tasks were left on the client's event loop and, once the launcher cancelled the futures,
  each printed an asyncio "Task exception was never retrieved ... AllExit" traceback. The
  launcher now polls the futures' states in its own thread (foundation.dask_wait).
- spark-submit: the terminal's SIGINT reached spark-submit's JVM too, which stopped Spark
  and exited while the Python driver was still cancelling its job; the driver's output,
  which that JVM carries, went with it (exit 130, no "aborted"; or Spark's own errors of
  the half-stopped context). The JVM now leaves Ctrl-C to the driver
  (foundation.spark_setup), as pyspark's own JVMs do.

Full tier only (markers `slow` and `cluster`: the session's Dask CLI cluster and Spark
standalone cluster; two CPU hogs beside each command, which is interrupted mid-training).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from shardline.training.checkpoints.store import CheckpointStore

from .conftest import REPO
from .faults_helpers import alive, cpu_hogs, rank_pids, start_driver, stop_group, train_args, wait_for
from .mlflow_store import empty_store, env_without_store

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

BIN = Path(sys.executable).parent
LOG4J = REPO / "shardline" / "foundation" / "log4j2.properties"


def _interrupt_and_check(proc: subprocess.Popen, ckpt: Path, log: Path) -> str:
    """Once the ranks checkpoint, Ctrl-C as a terminal sends it (SIGINT to the process group);
    the command's output, checked for the one-line ending, and the ranks for stopping."""
    store = CheckpointStore(str(ckpt))
    pids = wait_for(lambda: rank_pids(ckpt), "the first checkpoint", proc=proc, log=log)
    before = {Path(p).name for p in store.paths()}
    os.killpg(proc.pid, signal.SIGINT)
    code = proc.wait(timeout=300)
    out = log.read_text(errors="replace")
    assert code == 130, out[-3000:]
    lines = out.splitlines()
    assert "aborted" in lines, out[-3000:]
    assert not [ln for ln in lines[lines.index("aborted"):] if "[shardline] epoch" in ln], out[-3000:]
    for noise in ("Traceback", "Task exception was never retrieved", "AllExit", "\tat org.apache", " ERROR "):
        assert noise not in out, f"{noise!r} in the output:\n{out[-3000:]}"
    at_exit = {Path(p).name for p in store.paths()}
    assert len(at_exit - before) <= 1, f"committed after the signal: {sorted(at_exit - before)}"
    wait_for(lambda: not any(alive(p) for p in pids), f"ranks {pids} to stop", within_s=120)
    return out


def test_ctrl_c_on_a_dask_cluster_is_aborted_with_no_asyncio_traceback(prepared, dask_cli_cluster, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "driver.log"
    args = train_args(prepared.dataset_dir, ckpt, **{
        "training.launcher": "'dask'", "dask.address": f"'{dask_cli_cluster.address}'", "training.epochs": "400",
    })
    (tmp_path / "run").mkdir()
    empty_store(tmp_path / "run")
    with cpu_hogs(2):
        driver = start_driver(args, tmp_path / "run", log)
        try:
            _interrupt_and_check(driver, ckpt, log)
        finally:
            stop_group(driver)


def test_ctrl_c_under_spark_submit_is_aborted_and_exits_130(prepared, spark_standalone, tmp_path):
    """spark-submit on the session's standalone cluster, as the issue ran it; its settings
    given to spark-submit itself (it starts the JVM)."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "submit.log"
    conf = tomllib.loads(f"conf = {spark_standalone.conf}")["conf"]
    cmd = [str(BIN / "spark-submit"), "--master", spark_standalone.master,
           *[a for k, v in conf.items() for a in ("--conf", f"{k}={v}")],
           "--driver-java-options", f"-Dlog4j2.configurationFile=file:{LOG4J}",
           str(REPO / "jobs" / "spark_submit.py"),
           *train_args(prepared.dataset_dir, ckpt, **{"training.launcher": "'spark'", "training.epochs": "400"})]
    env = {**env_without_store(), **spark_standalone.env}
    empty_store(tmp_path)
    with cpu_hogs(2):
        with open(log, "wb") as sink:
            # Its own session: the test's SIGINT reaches its group (the JVM and the Python
            # driver), as a terminal's reaches the foreground job.
            submit = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            _interrupt_and_check(submit, ckpt, log)
        finally:
            stop_group(submit)
