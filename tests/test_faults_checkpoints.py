"""Checkpoint faults (#17 item 4): a truncated newest checkpoint falls back to the previous
readable one, said in one line, and still ends on the uninterrupted run's weights; a resume
with another lr (or any fingerprint field) is refused naming it, unless allowed, and then
the new value is the one used."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shardline.foundation.errors import ConfigError, DataError
from shardline.training.checkpoints.store import CheckpointStore, POINTER
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training

from .conftest import shardline_here
from .faults_helpers import error_lines, train_args


def _cfg(ckpt: Path, **kw) -> TrainingConfig:
    base = dict(launcher="local", world_size=2, epochs=3, batch_size=256, hidden=[64, 32],
                checkpoint_dir=str(ckpt), checkpoint_every_steps=5, keep_checkpoints=100, timeout_s=60)
    return TrainingConfig(**{**base, **kw})


def _tracking(name: str) -> TrackingConfig:
    return TrackingConfig(experiment=f"faults-{name}", registered_model=f"faults-{name}")


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory):
    """An uninterrupted run and its checkpoint directory (kept as written)."""
    ckpt = tmp_path_factory.mktemp("faults-ref") / "ckpt"
    return run_training(_cfg(ckpt), _tracking("ref"), prepared.dataset_dir), ckpt


def _copy_up_to(src: Path, dst: Path, keep: int) -> list[Path]:
    """The first `keep` checkpoints of `src` into `dst`, LATEST naming the last one."""
    dst.mkdir(parents=True)
    paths = [Path(p) for p in CheckpointStore(str(src)).paths()][:keep]
    for p in paths:
        shutil.copy(p, dst / p.name)
        dcp = torch.load(p, weights_only=True)["sharded"]  # its ranks' weights and optimizer state
        shutil.copytree(p.parent / dcp, dst / dcp)
    step = torch.load(paths[-1], weights_only=True)["global_step"]
    (dst / POINTER).write_text(f'{{"name": "{paths[-1].name}", "step": {step}}}')
    return [dst / p.name for p in paths]


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(prepared, reference, tmp_path, capfd):
    result, ref_ckpt = reference
    copied = _copy_up_to(ref_ckpt, tmp_path / "ckpt", keep=4)
    newest = copied[-1]
    newest.write_bytes(newest.read_bytes()[:1000])  # a write cut short
    resumed = run_training(_cfg(tmp_path / "ckpt", resume=True), _tracking("ref"), prepared.dataset_dir)
    said = [ln for ln in capfd.readouterr().err.splitlines() if "the newest readable one" in ln]
    assert said == [
        f"[shardline] {newest}: not a readable shardline checkpoint (" + said[0].split("(", 1)[1]
    ] and f"resuming from {copied[-2].name}, the newest readable one" in said[0], said
    # Resumed exactly from the older checkpoint: the same final weights as the uninterrupted run.
    for k, v in result.weights.items():
        assert torch.equal(resumed.weights[k], v), k


def test_no_readable_checkpoint_at_all_is_one_clear_error(prepared, reference, tmp_path):
    _, ref_ckpt = reference
    for p in _copy_up_to(ref_ckpt, tmp_path / "ckpt", keep=2):
        p.write_bytes(b"\0" * 64)
    with pytest.raises(DataError, match=r"not a readable shardline checkpoint .*; no older checkpoint in .* "
                                        r"is readable either"):
        run_training(_cfg(tmp_path / "ckpt", resume=True), _tracking("ref"), prepared.dataset_dir)


def test_resume_with_another_lr_is_refused_naming_it(prepared, reference, tmp_path):
    _, ref_ckpt = reference
    _copy_up_to(ref_ckpt, tmp_path / "ckpt", keep=3)
    with pytest.raises(DataError, match=r"different run: lr='0.003' \(config has '0.01'\) \(to resume with the "
                                        r"new value, allow it: --allow-changed lr\)"):
        run_training(_cfg(tmp_path / "ckpt", resume=True, lr=0.01), _tracking("ref"), prepared.dataset_dir)
    with pytest.raises(DataError, match=r"different run: lr_schedule='constant' \(config has 'cosine'\), "
                                        r"warmup_steps='0' \(config has '10'\)"):
        run_training(_cfg(tmp_path / "ckpt", resume=True, lr_schedule="cosine", warmup_steps=10),
                     _tracking("ref"), prepared.dataset_dir)
    with pytest.raises(ConfigError, match=r"training.resume_allow_changed: hidden cannot change on resume"):
        run_training(_cfg(tmp_path / "ckpt", resume=True, resume_allow_changed=["hidden"]),
                     _tracking("ref"), prepared.dataset_dir)


def test_an_allowed_lr_change_is_the_lr_used_after_resume(prepared, reference, tmp_path):
    result, ref_ckpt = reference
    copied = _copy_up_to(ref_ckpt, tmp_path / "ckpt", keep=3)
    resumed = run_training(_cfg(tmp_path / "ckpt", resume=True, lr=0.01, resume_allow_changed=["lr"]),
                           _tracking("ref"), prepared.dataset_dir)
    later = [p for p in CheckpointStore(str(tmp_path / "ckpt")).paths() if Path(p) not in copied]
    assert later, "the resumed job wrote no checkpoint"
    state = torch.load(later[-1], weights_only=True)
    assert state["fingerprint"]["lr"] == "0.01"
    for rank in state["ranks"]:  # the schedule's base and the optimizer's own lr are the new ones
        assert rank["scheduler"]["base_lrs"] == [0.01] and rank["scheduler"]["_last_lr"] == [0.01]
    assert any(not torch.equal(resumed.weights[k], v) for k, v in result.weights.items())


def test_cli_allow_changed_is_checked_before_anything_starts(prepared, reference, tmp_path):
    _, ref_ckpt = reference
    _copy_up_to(ref_ckpt, tmp_path / "ckpt", keep=3)
    args = train_args(prepared.dataset_dir, tmp_path / "ckpt",
                      **{"training.hidden": "[64, 32]", "training.epochs": "3", "training.lr": "0.01"})
    proc = shardline_here(*args, "--resume", "--allow-changed", "hidden", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error_lines(proc.stderr) == [
        "error: --allow-changed / training.resume_allow_changed: hidden cannot change on resume; fields that "
        "can: lr, weight_decay, lr_schedule, warmup_steps, epochs, dataset_version, code"
    ], proc.stderr[-2000:]
    proc = shardline_here(*args, "--resume", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]  # a refused --resume, as for changed code (#53 item 12)
    (line,) = error_lines(proc.stderr)
    assert "lr='0.003' (config has '0.01')" in line and "--allow-changed lr" in line, line
