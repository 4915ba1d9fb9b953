"""The jobs the multi-host bed runs inside host S (tests/multihost_bed.py), and their checks.

Each job is the shardline CLI the way a user runs it on a cluster's edge host; every
path is on s3://, MLflow is the server on host S. A failed check raises with one line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from .multihost_bed import QUICKSTART
from .multihost_hosts import IFNAME

JOB_TIMEOUT_S = 900


def run_jobs(bed) -> None:
    """Quickstart with host B's rank killed, the same training uninterrupted, and (--dask)
    the Dask launcher with host B's worker killed: the same final weights each time."""
    killed = _job(bed, "run", "ckpt-killed", kill="spark executor's Python worker")
    _check_restarted(killed, bed)
    _check_scores(bed)
    _check_stage_lines(killed["log"])
    # The uninterrupted reference trains on host S with the local launcher: the same ranks,
    # data and settings without a second Spark application (a driver JVM and two executors),
    # and the weights it must match do not depend on the engine the ranks ran on.
    reference = _job(bed, "train", "ckpt-reference", more=["--launcher", "local"], ifname="lo")
    _check_same_weights(bed, "ckpt-killed", "ckpt-reference")
    print(f"[bed] spark: a rank on host B killed mid-training (after {killed['kill_step']}); the job "
          f"resumed from the bucket and ended on the weights of the uninterrupted run "
          f"({killed['seconds']:.0f} s, reference {reference['seconds']:.0f} s)", flush=True)
    if bed.args.dask:
        dask = _job(bed, "train", "ckpt-dask", kill="Dask rank",
                    more=["--launcher", "dask", "--set", f"dask.address='{bed.dask_address}'"])
        _check_restarted(dask, bed)
        _check_same_weights(bed, "ckpt-dask", "ckpt-reference")
        print(f"[bed] dask: a rank on host B killed mid-training (after {dask['kill_step']}); resumed from the "
              f"bucket, same weights ({dask['seconds']:.0f} s)", flush=True)


def _settings(bed, ckpt: str, ifname: str = IFNAME) -> list[str]:
    s = bed.s.address
    conf = {"spark.executor.cores": "1", "spark.cores.max": "2", "spark.driver.host": s, "spark.driver.bindAddress": s}
    if os.environ.get("SPARK_DAEMON_JAVA_OPTS"):
        # The test suite's JVM flags (tests/conftest.py: speed, not behaviour) reach the
        # driver and the daemons through the environment; an executor is started by its
        # worker with only spark.executor.extraJavaOptions.
        conf["spark.executor.extraJavaOptions"] = os.environ["SPARK_DAEMON_JAVA_OPTS"]
    sets = {
        "spark.master": f"'{bed.spark_master}'",
        "spark.conf": "{" + ", ".join(f"'{k}' = '{v}'" for k, v in conf.items()) + "}",
        "pipelines.dataset_dir": f"'{bed.bucket}/quickstart/dataset'",
        "pipelines.source.path": f"'{bed.bucket}/quickstart/raw'",
        "pipelines.source.synthetic.rows": str(bed.args.rows),
        "training.epochs": str(bed.args.epochs),
        "training.checkpoint_dir": f"'{bed.bucket}/quickstart/{ckpt}'",
        "training.checkpoint_every_steps": "10",
        "training.keep_checkpoints": "100",
        "training.timeout_s": "120",
        "training.socket_ifname": f"'{ifname}'",
        "tracking.tracking_uri": f"'{bed.tracking_uri}'",
        "serving.output_dir": f"'{bed.bucket}/quickstart/scores'",
    }
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def _job(bed, command: str, ckpt: str, kill: str | None = None, more: list[str] = (), ifname: str = IFNAME) -> dict:
    """Run `shardline COMMAND quickstart.toml` on host S; with `kill`, SIGKILL the rank on host B
    once the first checkpoint is in the bucket. `ifname`: the ranks' hosts' interface."""
    cmd = [sys.executable, "-m", "shardline.jobs.cli", command, str(QUICKSTART), *_settings(bed, ckpt, ifname), *more]
    log = bed.logs / f"{command}-{ckpt}.log"
    print(f"[bed] shardline {command} quickstart.toml ({ckpt}) ...", flush=True)
    start = time.monotonic()
    done, outcome = threading.Event(), {}
    watcher = threading.Thread(
        target=_kill_rank_on_b, args=(bed, f"{bed.bucket}/quickstart/{ckpt}", done, outcome), daemon=True
    )
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=bed.bed.work, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **bed.env, "SPARK_LOCAL_IP": bed.s.address},
                                start_new_session=True)
        bed.procs.append(proc)
        if kill:
            watcher.start()
        try:
            code = proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"shardline {command} ({ckpt}) not done within {JOB_TIMEOUT_S} s") from None
        finally:
            done.set()
    text = log.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"shardline {command} ({ckpt}) exited {code}: {text[-3000:]}")
    if kill and "pid" not in outcome:
        raise RuntimeError(f"{kill} on host B was never killed: {outcome.get('why', 'training ended first')}")
    print(text[-1500:], flush=True)
    return {**outcome, "log": text, "seconds": time.monotonic() - start}


def _kill_rank_on_b(bed, ckpt_dir: str, done: threading.Event, outcome: dict) -> None:
    """When a checkpoint is in the bucket, SIGKILL the rank whose process is on host B (its
    /proc/<pid>/ns/net is B's namespace): the Spark Python worker running it, or the process its
    Dask worker forked for it."""
    from shardline.foundation import storage
    from shardline.training.checkpoints.store import CheckpointStore

    on_b = bed.bed.hosts["b"].netns_inode
    while not done.is_set():
        try:
            ckpts = CheckpointStore(ckpt_dir).paths()
            ranks = [json.loads(storage.read_bytes(f"{ckpt_dir}/ranks/rank-{r}.json")) for r in (0, 1)]
        except (FileNotFoundError, OSError, ValueError):
            ckpts = []
        if ckpts:
            for info in ranks:
                try:
                    if os.stat(f"/proc/{info['pid']}/ns/net").st_ino == on_b:
                        os.kill(info["pid"], signal.SIGKILL)
                        outcome.update(pid=info["pid"], rank=info["rank"], kill_step=storage.name(ckpts[-1]))
                        return
                except (FileNotFoundError, ProcessLookupError):
                    pass  # the rank file of an earlier attempt
            outcome["why"] = f"no rank's process is on host B: {ranks}"
        time.sleep(0.1)


def _check_restarted(job: dict, bed) -> None:
    from mlflow.tracking import MlflowClient

    lines = [ln for ln in job["log"].splitlines() if "restarting from" in ln]
    if len(lines) != 1 or "restarting from the start" in lines[0]:
        raise RuntimeError(f"expected one restart from a checkpoint in the bucket, got: {lines}")
    # `train` prints "run <id>; ...", `run` a table row "MLflow run │ <id>".
    found = re.search(r"(?:^\s*run|MLflow run\s*│)\s+([0-9a-f]{32})", job["log"], re.M)
    if found is None:
        raise RuntimeError("the job printed no MLflow run id")
    run_id = found[1]
    restarts = MlflowClient(bed.tracking_uri).get_run(run_id).data.metrics.get("restarts")
    if restarts != 1:
        raise RuntimeError(f"MLflow run {run_id}: restarts = {restarts}, expected 1")


def _final_weights(bed, ckpt: str) -> dict:
    from shardline.training.checkpoints import sharded
    from shardline.training.checkpoints.store import CheckpointStore

    latest = CheckpointStore(f"{bed.bucket}/quickstart/{ckpt}").latest()
    if latest is None:
        raise RuntimeError(f"no checkpoint in {bed.bucket}/quickstart/{ckpt}")
    state = CheckpointStore.holding(latest).read(latest)
    if state["epoch"] != bed.args.epochs:
        raise RuntimeError(f"{latest}: epoch {state['epoch']}, expected the last ({bed.args.epochs})")
    return sharded.read_weights(latest)


def _check_same_weights(bed, ckpt: str, reference: str) -> None:
    import torch

    got, want = _final_weights(bed, ckpt), _final_weights(bed, reference)
    if got.keys() != want.keys():
        raise RuntimeError(f"{ckpt} and {reference} hold different parameters")
    differ = [k for k in got if not torch.equal(got[k], want[k])]
    if differ:
        raise RuntimeError(f"{ckpt} ends on other weights than {reference}: {differ}")


def _check_stage_lines(log: str) -> None:
    """Prepare's and scoring's unit counts reached the console on host S from the
    executors on hosts A and B (foundation.progress)."""
    for pattern in (r"\[shardline\] prepare pass 1: (\d+)/\1 units read",
                    r"\[shardline\] prepare write: \d+/\d+ shards written",
                    r"\[shardline\] score: (\d+)/\1 units scored \([\d,]+ rows\)"):
        if not re.search(pattern, log):
            raise RuntimeError(f"no line matching {pattern!r} on the driver's console")


def _check_scores(bed) -> None:
    """Every test row scored once, in the bucket (the quickstart's last stage)."""
    import pyarrow.parquet as pq

    from shardline.foundation import storage
    from shardline.pipelines.manifest import load_manifest

    out = f"{bed.bucket}/quickstart/scores"
    files = [f for f in storage.find_files(out) if f.endswith(".parquet")]
    keys = [k for f in files for k in pq.read_table(storage.open_input(f)).column("key").to_pylist()]
    rows = load_manifest(f"{bed.bucket}/quickstart/dataset").splits["test"].rows
    if not files or len(keys) != len(set(keys)) or len(keys) != rows:
        raise RuntimeError(f"scores in {out}: {len(keys)} rows ({len(set(keys))} distinct), test split has {rows}")


