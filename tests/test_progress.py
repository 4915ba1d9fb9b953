"""training.progress: ranks' lines reach the driver's console over a socket, and a rank
whose driver cannot be reached prints them itself instead of waiting."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from training import progress
from training.launchers import free_port

from .conftest import REPO


def _wait_for(out: io.StringIO, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_lines_from_another_process_reach_the_listener_in_order():
    out = io.StringIO()
    with progress.ProgressListener("127.0.0.1", out=out) as listener:
        code = (
            "from training import progress\n"
            f"for i in range(3): progress.say({listener.address!r}, f'[shardline] epoch {{i + 1}}/3: ok')\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        _wait_for(out, "epoch 3/3")
    assert out.getvalue().splitlines() == [f"[shardline] epoch {i}/3: ok" for i in (1, 2, 3)]
    assert proc.stderr == ""  # sent, not printed by the sender


def test_an_unreachable_driver_makes_the_rank_print_the_line_itself():
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    code = f"from training import progress\nprogress.say({nobody!r}, 'epoch 1/1: ok')\nprogress.say({nobody!r}, 'epoch 2/2: ok')\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr.splitlines() == ["epoch 1/1: ok", "epoch 2/2: ok"], proc.stderr


def test_local_ranks_route_to_loopback():
    assert progress.listen_address("local") == "127.0.0.1"
    assert progress._route_to("localhost") == "127.0.0.1"
