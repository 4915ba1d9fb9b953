"""Helpers of the fault tests: a training driver run as a user runs it, mounts placed by
the test (read-only, full), and waiting on conditions (never on fixed sleeps)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardline.foundation.lease import process_alive
from shardline.training.checkpoints.store import CheckpointStore

from .conftest import REPO
from .mlflow_store import env_without_store

QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"
# A loaded 2-core machine starts a driver and its ranks in minutes, not seconds.
UP_WITHIN_S = 400


def train_args(dataset_dir: str, ckpt: Path, **settings) -> list[str]:
    sets = {
        "pipelines.dataset_dir": f"'{dataset_dir}'",
        "training.launcher": "'local'",
        "training.hidden": "[16]",
        "training.batch_size": "256",
        "training.checkpoint_dir": f"'{ckpt}'",
        "training.checkpoint_every_steps": "5",
        "tracking.experiment": "'faults'",
        "tracking.registered_model": "'faults'",
        **settings,
    }
    return ["train", str(QUICKSTART)] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def start_driver(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """`shardline ARGS` in its own session: the test can SIGKILL the driver alone, and
    its cleanup can stop the whole group (ranks included) if they outlived it."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = env_without_store()
    with open(log, "wb") as sink:
        return subprocess.Popen([sys.executable, "-m", "shardline.jobs.cli", *args], cwd=cwd, env=env,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def stop_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def wait_for(condition, what: str, within_s: float = UP_WITHIN_S, proc: subprocess.Popen | None = None,
             log: Path | None = None):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise AssertionError(f"the driver exited ({proc.returncode}) before {what}:\n{tail}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def rank_pids(ckpt: Path, world_size: int = 2) -> list[int] | None:
    """The ranks' pids once each has announced itself and a checkpoint exists."""
    files = [ckpt / "ranks" / f"rank-{r}.json" for r in range(world_size)]
    if not CheckpointStore(str(ckpt)).paths() or not all(f.exists() for f in files):
        return None
    try:
        return [json.loads(f.read_text())["pid"] for f in files]
    except ValueError:  # being rewritten by a relaunch
        return None


def alive(pid: int) -> bool:
    return process_alive(pid, "")  # a zombie (killed, not reaped) counts as gone


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str):
    """A tmpfs at `path` (e.g. "ro" or "size=32k"): a read-only or full file system, real
    for root too (chmod stops no root). Unmounted after, also on failure."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "shardline-faults", str(path)], check=True)
    try:
        yield path
    finally:
        for _ in range(20):  # a rank may still hold a file there for a moment
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def cpu_hogs(n: int = 2):
    """`n` busy loops beside the test (`python -c "while True: pass"`): a machine loaded as
    users' are, where starts and imports take many times their idle time. Killed by pid
    after, also on failure."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


def parent_pid(pid: int) -> int:
    """The parent of process `pid` (Linux /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])
