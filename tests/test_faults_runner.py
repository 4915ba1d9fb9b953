"""`python -m jobs.faults`: the fault cases a user points at their own setup, run here on
local ranks (the launcher a laptop has), each case's verdict one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

CASES = ("kill-rank", "truncated-checkpoint", "changed-lr", "full-disk", "stale-lease")


@pytest.mark.slow
def test_the_runner_passes_every_case_on_local_ranks_and_leaves_nothing(prepared, tmp_path):
    ckpt = tmp_path / "ckpt"
    config = tmp_path / "faults.toml"
    config.write_text(f"""
[pipelines]
dataset_dir = "{prepared.dataset_dir}"

[training]
launcher = "local"
world_size = 2
epochs = 2
batch_size = 256
hidden = [32]
checkpoint_dir = "{ckpt}"
checkpoint_every_steps = 5
keep_checkpoints = 100
max_restarts = 2
timeout_s = 60

[tracking]
tracking_uri = "sqlite:///{tmp_path / 'mlflow.db'}"
experiment = "faults-runner"
""")
    proc = subprocess.run([sys.executable, "-m", "shardline.jobs.faults", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    verdicts = [ln for ln in proc.stdout.splitlines() if ln.split(":")[0] in CASES]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # As root (this machine, CI) the full-disk case mounts its small disk and runs.
    assert [ln.split(":")[:2] for ln in verdicts] == [[c, " PASS"] for c in CASES], verdicts
    assert "relaunched, bit-equal" in verdicts[0] and "resumed from the previous one" in verdicts[1]
    assert "refused" in verdicts[2] and "lr=" in verdicts[2]
    assert "No space left on device" in verdicts[3] and "no relaunch" in verdicts[3]
    assert "is gone" in verdicts[4] and "bit-equal" in verdicts[4]
    assert not [p for p in ckpt.iterdir() if p.name.startswith("_faults-")] if ckpt.exists() else True


def test_the_runner_lists_its_cases_and_refuses_an_unknown_one(tmp_path):
    listed = subprocess.run([sys.executable, "-m", "shardline.jobs.faults", "--list"], cwd=REPO, capture_output=True, text=True)
    assert listed.returncode == 0 and listed.stdout.split() == list(CASES)
    bad = subprocess.run([sys.executable, "-m", "shardline.jobs.faults", "x.toml", "--case", "nope"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr
