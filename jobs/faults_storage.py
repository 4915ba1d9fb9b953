"""The fault runner's storage cases (`python -m shardline.jobs.faults`, see jobs.faults).

- full-disk: the checkpoint folder on a full disk (a small tmpfs the runner mounts, so
  only as root and for a local checkpoint_dir; else SKIP, saying why). The job must end
  in one line naming the cause, with no relaunch: a full disk is permanent
  (foundation.failures).
- stale-lease: jobs that took a lease and were SIGKILLed. Of a scoring output's,
  `shardline score --status` must say the holder is gone, not "being written now"; a
  checkpoint folder's the next training job must take over and end bit-equal to the
  reference.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile

from shardline.foundation import storage
from shardline.foundation.errors import ShardlineError
from shardline.foundation.lease import LEASE_NAME, Holder, Lease
from shardline.serving.status import output_status

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs).


def full_disk_needs(root: str) -> str | None:
    """Why full-disk cannot run here (None: it can): the runner checks before anything runs."""
    if storage.is_remote(root):
        return "checkpoint_dir is not a local path: the runner can fill only a disk it mounts"
    if os.geteuid() != 0:
        return "mounting a small disk (tmpfs) needs root"
    return None


def full_disk(cfg, ref, root: str, handles: dict, train) -> tuple[str, str]:
    if why := full_disk_needs(root):
        return "SKIP", why
    disk = storage.local_path(storage.join(root, "full-disk"))
    os.makedirs(disk)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", disk], capture_output=True, text=True)
    if mounted.returncode:
        return "SKIP", f"could not mount a tmpfs ({mounted.stderr.strip()[:120]})"
    try:
        _fill(disk, leave=16384)  # room for the lease (it is taken first), none for a checkpoint
        said = io.StringIO()  # the driver's console: a relaunch says "restarting from"
        try:
            with contextlib.redirect_stderr(said):
                train(cfg, os.path.join(disk, "ckpt"), handles)
        except ShardlineError as e:
            line = str(e)
            if "\n" in line or "No space left" not in line:
                return "FAIL", f"refused, but not in one line naming the full disk: {line[:200]}"
            if "restarting from" in said.getvalue():
                return "FAIL", f"a full disk was retried: {line[:200]}"
            return "PASS", f"one line, no relaunch: ...{line[-150:]}"  # its end names the cause
        finally:
            sys.stderr.write(said.getvalue())
        return "FAIL", "training on a full disk succeeded: the case did not fill the disk"
    finally:
        if subprocess.run(["umount", disk], capture_output=True).returncode:
            subprocess.run(["umount", "-l", disk], capture_output=True)


def _fill(disk: str, leave: int) -> None:
    with open(os.path.join(disk, "filler"), "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
        f.truncate(max(0, f.tell() - leave))


def stale_lease(cfg, ref, root: str, handles: dict, train) -> tuple[str, str]:
    # A scoring output whose job was killed: `score --status` must not call it live.
    scores = storage.join(root, "stale-status")
    dead = _lease_of_a_killed_job(storage.join(scores, LEASE_NAME), "shardline score")
    said = output_status(scores).stale
    if said is None:
        return "FAIL", f"score --status reports the killed job (pid {dead.pid}) as writing now"
    # A checkpoint folder whose job was killed: the next job takes it over.
    ckpt = storage.join(root, "stale-lease")
    _lease_of_a_killed_job(storage.join(ckpt, LEASE_NAME), "shardline train")
    result = train(cfg, ckpt, handles)
    if not _equal(result.weights, ref.weights):
        return "FAIL", "took the killed job's lease over, but the final weights differ from the reference"
    return "PASS", f"score --status: lease {said}; a training job took a killed one's lease over, bit-equal"


def _lease_of_a_killed_job(url: str, job: str) -> Holder:
    """The lease at `url` of a real process that took it and was SIGKILLed (no release)."""
    code = ("import os, signal, sys; from shardline.foundation.lease import Lease; "
            "Lease(sys.argv[1], sys.argv[2]).acquire(); os.kill(os.getpid(), signal.SIGKILL)")
    with tempfile.TemporaryDirectory() as cwd:
        subprocess.run([sys.executable, "-c", code, url, f"{job} (killed by the fault runner)"], cwd=cwd,
                       capture_output=True, timeout=300)
    holder = Lease.holder(url)
    if holder is None:
        raise ShardlineError(f"stale-lease: the killed job left no lease at {storage.display(url)}")
    return holder


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
