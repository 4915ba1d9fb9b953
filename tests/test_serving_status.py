"""`shardline score --status` says whether the lease it finds belongs to a live job, judged as
the next run judges it (foundation.lease.Holder.stale): a dead holder's lease is not "being
written now". Engine-free: the CLI runs in this process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from shardline.foundation.lease import Holder
from shardline.serving.ledger import output_lease

from .conftest import REPO, shardline_here


def _status(out: Path, cwd: Path) -> str:
    r = shardline_here("score", "--status", str(out), cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def _lease_of_a_killed_job(out: Path) -> Holder:
    code = ("import os, signal, sys; from shardline.serving.ledger import output_lease; "
            "output_lease(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)")
    dead = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert dead.returncode == -9, dead.stderr
    return Holder.parse((out / "_lease.json").read_bytes())


def test_status_tells_a_live_writer_from_a_dead_one(tmp_path):
    out = tmp_path / "scores"
    out.mkdir()

    with output_lease(out):  # a live job: this process
        line = _status(out, tmp_path)
    assert line.startswith(f"being written now by shardline score (host {socket.gethostname()}, pid {os.getpid()}")

    # A job SIGKILLed while it held the output: its pid is gone.
    dead = _lease_of_a_killed_job(out)
    line = _status(out, tmp_path)
    assert line.startswith("no job is writing it now: shardline score"), line
    assert f"pid {dead.pid}" in line and f"its process {dead.pid} on this host is gone" in line, line
    assert "the next run takes it over" in line

    # A job on another host that stopped renewing 35 s ago.
    other = replace(dead, host="elsewhere", boot_id="", pid_ns="", expires_at=time.time() - 35)
    (out / "_lease.json").write_text(json.dumps(asdict(other)))
    line = _status(out, tmp_path)
    assert line.startswith("no job is writing it now: shardline score (host elsewhere"), line
    assert re.search(r"left its lease \(expired \d+ s ago\)", line), line

    # The same job still renewing: live, whatever its host.
    (out / "_lease.json").write_text(json.dumps(asdict(replace(other, expires_at=time.time() + 600))))
    assert _status(out, tmp_path).startswith("being written now by shardline score (host elsewhere")
