"""`python -m jobs.faults`: the fault cases a user points at their own setup, run here on
local ranks (the launcher a laptop has), each case's verdict one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .cli_inprocess import run_python
from .conftest import REPO

CASES = ("kill-rank", "truncated-checkpoint", "changed-lr", "full-disk", "stale-lease")


@pytest.mark.slow
def test_the_runner_passes_every_case_on_local_ranks_and_leaves_nothing(prepared, new_store, tmp_path):
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
tracking_uri = "{new_store(tmp_path / 'mlflow.db')}"
experiment = "faults-runner"
""")
    # `python -m shardline.jobs.faults CONFIG` run in this process (its entry point as a process:
    # the test below): its ranks fork from the fork server this process already has, with torch
    # and MLflow imported, instead of a new Python importing them and starting a server of its own.
    code, out, err = run_python("import sys; from shardline.jobs.faults import main; sys.exit(main(sys.argv[1:]))",
                                [str(config)], tmp_path)
    verdicts = [ln for ln in out.splitlines() if ln.split(":")[0] in CASES]
    assert code == 0, out[-2000:] + err[-3000:]
    # As root (this machine, CI) the full-disk case mounts its small disk and runs.
    assert [ln.split(":")[:2] for ln in verdicts] == [[c, " PASS"] for c in CASES], verdicts
    assert "relaunched, bit-equal" in verdicts[0] and "resumed from the previous one" in verdicts[1]
    assert "refused" in verdicts[2] and "lr=" in verdicts[2]
    assert "No space left on device" in verdicts[3] and "no relaunch" in verdicts[3]
    assert "is gone" in verdicts[4] and "bit-equal" in verdicts[4]
    assert not [p for p in ckpt.iterdir() if p.name.startswith("_faults-")] if ckpt.exists() else True


def test_the_runner_lists_its_cases_and_refuses_an_unknown_one(tmp_path):
    # The two processes side by side: each is mostly a Python starting.
    listing, refusing = procs = [subprocess.Popen([sys.executable, "-m", "shardline.jobs.faults", *args], cwd=REPO,
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                                 for args in (["--list"], ["x.toml", "--case", "nope"])]
    try:
        (listed, _), (_, refused) = (p.communicate(timeout=300) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert listing.returncode == 0 and listed.split() == list(CASES)
    assert refusing.returncode == 2 and "invalid choice: 'nope'" in refused
