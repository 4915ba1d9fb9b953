"""`python -m jobs.faults`: the fault cases a user points at their own setup, run here on
local ranks (the launcher a laptop has), each case's verdict one line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .cli_inprocess import run_python
from .conftest import REPO

CASES = ("kill-rank", "truncated-checkpoint", "changed-lr", "ctrl-c", "full-disk", "stale-lease")


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
    assert "committed after the signal" in verdicts[3] and "--resume ended bit-equal" in verdicts[3]
    assert "No space left on device" in verdicts[4] and "no relaunch" in verdicts[4]
    assert "is gone" in verdicts[5] and "bit-equal" in verdicts[5]
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


def _config(tmp_path, prepared, tracking_uri: str, **training) -> str:
    sets = {"launcher": "'local'", "world_size": "2", "batch_size": "256", "hidden": "[16]",
            "checkpoint_dir": f"'{tmp_path / 'ckpt'}'", "timeout_s": "60", **training}
    config = tmp_path / "faults.toml"
    config.write_text(f'[pipelines]\ndataset_dir = "{prepared.dataset_dir}"\n\n[training]\n'
                      + "".join(f"{k} = {v}\n" for k, v in sets.items())
                      + f'\n[tracking]\ntracking_uri = "{tracking_uri}"\nexperiment = "faults-plan"\n')
    return str(config)


def test_a_case_the_config_cannot_give_is_refused_before_anything_runs(prepared, tracking_uri, tmp_path):
    """Two epochs, checkpoints at epoch ends only: two checkpoints, and truncated-checkpoint
    needs three. Asked for by name, it is refused in one line naming what it needs and the
    fix (exit 2), before a reference trains: not a FAIL after a whole reference run (#46)."""
    config = _config(tmp_path, prepared, tracking_uri, epochs="2")
    code, out, err = run_python("import sys; from shardline.jobs.faults import main; sys.exit(main(sys.argv[1:]))",
                                [config, "--case", "truncated-checkpoint"], tmp_path)
    assert code == 2, out + err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and re.fullmatch(
        r"error: --case truncated-checkpoint: needs 3 checkpoints kept, but the reference keeps 2 \(training\.epochs "
        r"2 x \d+ steps, training\.checkpoint_every_steps 0 \(epoch ends only\), training\.keep_checkpoints 3\): "
        r"raise training\.epochs or set a smaller training\.checkpoint_every_steps", lines[0]), err
    assert not out.strip() and not (tmp_path / "ckpt").exists()  # nothing trained, nothing written


def test_the_runners_plan_counts_the_checkpoints_a_run_writes(prepared, tracking_uri, tmp_path):
    """What the runner decides a case on: the reference's checkpoints, worked out from the
    config and the manifest, equal those a real run writes (mid-epoch and epoch ends)."""
    from shardline.config import load_config
    from shardline.training.checkpoints.store import CheckpointStore
    from shardline.jobs.faults import checkpoints_planned
    from shardline.engines import LocalEngine
    from shardline.training.job import run_training

    cfg = load_config(_config(tmp_path, prepared, tracking_uri, epochs="2", checkpoint_every_steps="7",
                              keep_checkpoints="100"))
    written, kept, _ = checkpoints_planned(cfg)
    run_training(cfg.training, cfg.tracking, cfg.pipelines.dataset_dir, LocalEngine(), register=False)
    assert len(CheckpointStore(cfg.training.checkpoint_dir).paths()) == written == kept > 2
