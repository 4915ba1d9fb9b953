"""A user's model whose forward raises while training (#46): one line naming the rank, the
exception and the user's own frame, and the full traceback in the rank's log file under
the checkpoint folder, on the local launcher and on a real Spark barrier stage (no Java
stack trace on the console). A deterministic bug is permanent: never relaunched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training
from shardline.training.launchers import TrainingFailed

PACKAGE = str(Path(__file__).parent / "usermodels" / "usernets")
RAISE_LINE = next(i for i, ln in enumerate((Path(PACKAGE) / "faults.py").read_text().splitlines(), 1)
                  if ln.strip().startswith("raise ValueError"))
PREFIX = {"local": "local", "spark": "Spark barrier stage", "dask": "Dask"}
HANDLES = {"spark": "spark", "dask": "dask_client"}


@pytest.mark.parametrize("launcher", ["local", "spark", "dask"])
def test_a_users_forward_that_raises_is_one_line_naming_its_frame_and_its_log(
    prepared, tmp_path, capfd, launcher, request
):
    handles = {HANDLES[launcher]: request.getfixturevalue(HANDLES[launcher])} if launcher in HANDLES else {}
    ckpt = tmp_path / "ckpt"
    cfg = TrainingConfig(launcher=launcher, world_size=2, epochs=1, batch_size=256, checkpoint_dir=str(ckpt),
                         model="usernets.faults:raises_in_training", code_paths=[PACKAGE], max_restarts=2,
                         timeout_s=60)
    with pytest.raises(TrainingFailed) as failed:
        run_training(cfg, TrackingConfig(experiment=f"forward-{launcher}"), prepared.dataset_dir, **handles)
    line = str(failed.value)
    # Both ranks fail alike: said once, "rank N the same" (#53 item 16). The local launcher
    # hears both; Dask's gather hands over the first, and the driver waits a moment for the
    # other (a running task is not stopped). Spark reports the stage's first failed task and
    # stops the other, which may not have reached its forward (rank 0 opens the MLflow run
    # first): "the same" only when that rank's log of this attempt says so.
    said = re.fullmatch(
        rf"{PREFIX[launcher]} training failed: rank (\d) on \S+: ValueError: boom: this model fails in "
        rf"training \(at usernets/faults\.py, line {RAISE_LINE}, in forward(; rank \d the same)?; "
        rf"traceback in {re.escape(str(ckpt))}/ranks/rank-(\d)\.log\)", line)
    assert said and said[1] == said[3], line
    assert said[2] in ((f"; rank {1 - int(said[1])} the same", None) if launcher == "spark" else
                       (f"; rank {1 - int(said[1])} the same",)), line
    assert failed.value.permanent  # a relaunch would replay the same batch on the same weights
    log = (ckpt / "ranks" / f"rank-{said[1]}.log").read_text()
    assert "Traceback (most recent call last)" in log and "torch/nn/modules/module.py" in log, log
    assert f'usernets/faults.py", line {RAISE_LINE}, in forward' in log, log
    assert log.rstrip().endswith("ValueError: boom: this model fails in training"), log
    err = capfd.readouterr().err
    assert "restarting from" not in err  # never relaunched
    # No traceback and no Java stack trace on the console: the line above says it all.
    assert "Traceback" not in err and "ERROR Executor" not in err and "\tat org.apache" not in err, err[-3000:]
