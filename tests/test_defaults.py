"""Safe defaults on a user's own small data (#16 items 1 and 7): no silent non-training,
checkpoints per job, and the exit codes the reference page promises (its table is
tests/bad_input_cases.py: EXIT_CODES, rendered into docs/reference/errors.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardline.engines import LocalEngine
from shardline.config import load_config, resolve_paths
from shardline.foundation.errors import ConfigError, DataError, LeaseHeld, ShardlineError
from shardline.training.checkpoints import fingerprint
from shardline.training.checkpoints.store import CheckpointStore, POINTER
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training

from .bad_input_cases import EXIT_CODES
from .conftest import REPO, shardline, shardline_here
from .defaults_helpers import small_dataset  # noqa: F401 (a fixture)


def _config(tmp_path: Path, dataset_dir: str, extra: str = "") -> Path:
    path = tmp_path / "small.toml"
    path.write_text(
        f"[pipelines]\ndataset_dir = '{dataset_dir}'\n"
        f"[pipelines.features]\nnumeric = ['a', 'b', 'c']\ncategorical = []\n"
        f"[training]\nlauncher = 'spark'\nworld_size = 2\n{extra}"
    )
    return path


# -- item 1: no silent non-training -------------------------------------------------------


def test_zero_steps_is_refused_before_any_engine_starts(small_dataset, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    proc = shardline_here("train", str(_config(tmp_path, small_dataset.dataset_dir)), cwd=work)
    assert proc.returncode == 1, proc.stderr  # a refused run
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    msg = lines[0]
    # The numbers (global batch, per-rank batch, rows per rank) and the fix.
    assert "training.batch_size 512 is 256 rows per step on each of 2 data-parallel rank(s)" in msg, msg
    assert "0 optimizer steps" in msg and "train rows per rank: [" in msg, msg
    fit = int(re.search(r"set training.batch_size to at most (\d+)", msg).group(1))
    per_rank = [int(n) for n in re.search(r"train rows per rank: \[([\d, ]+)\]", msg).group(1).split(",")]
    assert fit == 2 * min(per_rank) and 0 < fit < 512
    # Nothing started or written: no Spark, no store, no checkpoints.
    assert "Starting Spark" not in proc.stdout + proc.stderr
    assert list(work.iterdir()) == []


def _csv_442(folder: Path) -> Path:
    """A 442-row table (a classic small one) as CSV."""
    (folder / "raw").mkdir(parents=True)
    rows = "".join(f"{k},{k % 7 * 0.5},{k % 5 - 2.0},{k % 3 * 1.5},{k % 3}\n" for k in range(442))
    (folder / "raw" / "part-0.csv").write_text("key,a,b,c,label\n" + rows)
    return folder / "raw"


def test_run_refuses_the_default_batch_on_a_small_source_before_any_engine(tmp_path):
    """#46: `shardline run` with the default batch (512) on 442 rows was refused only after
    Spark started and prepare ran; now from the source's row count, before either."""
    work = tmp_path / "work"
    work.mkdir()
    raw = _csv_442(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(
        f"[pipelines]\ndataset_dir = '{tmp_path / 'dataset'}'\n"
        f"[pipelines.source]\nformat = 'csv'\npath = '{raw}'\n"
        f"[pipelines.features]\nkey = 'key'\nlabel = 'label'\nnumeric = ['a', 'b', 'c']\ncategorical = []\n"
        f"[training]\nlauncher = 'spark'\nworld_size = 2\n"
    )
    proc = shardline_here("run", str(config), cwd=work)
    assert proc.returncode == 1, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: training.batch_size 512 is 256 rows per step on each of 2 data-parallel rank(s), "
                           "but the source's 442 rows give each rank about 177 train rows"), line
    suggested = int(re.search(r"set training.batch_size to at most (\d+)", line).group(1))
    assert 0 < suggested <= 340  # 340: what the prepared split allows (the late check's figure)
    assert "Starting" not in proc.stdout + proc.stderr
    assert list(work.iterdir()) == [] and not (tmp_path / "dataset").exists()


def test_a_batch_the_source_may_allow_is_left_to_the_exact_check(tmp_path):
    from shardline.pipelines.config import PipelineConfig
    from shardline.pipelines.raw import describe
    from shardline.pipelines.sources import list_files
    from shardline.training.source_steps import check_steps_from_source, source_rows

    raw = _csv_442(tmp_path)
    pipelines = PipelineConfig.model_validate({"source": {"format": "csv", "path": str(raw)}})
    files = describe(list_files(pipelines.source), "csv", ",")
    assert source_rows(pipelines, files) == 442
    for batch in (256, 340, 400):  # about 177 train rows a rank: close enough to leave to the prepared split
        check_steps_from_source(TrainingConfig(world_size=2, batch_size=batch), pipelines, files)
    check_steps_from_source(TrainingConfig(world_size=2, batch_size=512, remainder="pad"), pipelines, files)
    with pytest.raises(DataError, match="0 optimizer steps"):
        check_steps_from_source(TrainingConfig(world_size=2, batch_size=512), pipelines, files)


def test_the_suggested_batch_trains_and_registers(small_dataset, tracking_uri, capfd):
    from mlflow.tracking import MlflowClient

    # The default data-wait settings: a small run's start-up wait is not worth a warning.
    cfg = TrainingConfig(launcher="local", world_size=2, epochs=1)
    with pytest.raises(DataError, match=r"at most (\d+)") as e:
        run_training(cfg, TrackingConfig(), small_dataset.dataset_dir, LocalEngine())
    fit = int(re.search(r"at most (\d+)", str(e.value)).group(1))
    tracking = TrackingConfig(experiment="defaults", registered_model="defaults-fit")
    result = run_training(cfg.model_copy(update={"batch_size": fit}), tracking, small_dataset.dataset_dir, LocalEngine())
    assert MlflowClient(tracking_uri).get_model_version("defaults-fit", result.model_version).run_id == result.run_id
    assert result.metrics["samples_per_s"] > 0 and 0 <= result.metrics["data_wait_fraction"] <= 1
    err = capfd.readouterr().err
    assert "waited for data" not in err, err


def test_the_data_wait_warning_needs_a_long_wait_over_many_steps():
    from shardline.training.loop.recipe import data_wait_worth_warning

    cfg = TrainingConfig()  # 5%, 5 s, 20 steps
    assert data_wait_worth_warning(cfg, 0.5, 6.0, 20)
    # A large share alone is the start-up of a short run: no warning.
    assert not data_wait_worth_warning(cfg, 0.9, 0.4, 8)
    assert not data_wait_worth_warning(cfg, 0.9, 6.0, 19)
    assert not data_wait_worth_warning(cfg, 0.9, 4.9, 200)
    assert not data_wait_worth_warning(cfg, 0.05, 60.0, 200)
    zero = cfg.model_copy(update={"data_wait_warning": 0.0, "data_wait_warning_min_s": 0.0,
                                  "data_wait_warning_min_steps": 0})
    assert data_wait_worth_warning(zero, 0.01, 0.001, 1)


def test_a_job_that_took_no_step_is_never_registered(small_dataset, tracking_uri, monkeypatch, capfd):
    """Should a 0-step job get past preflight, the driver still refuses to log or register
    its model, and the data-wait warning (threshold 0: any wait warns) stays silent:
    with no step there was no wait to warn about."""
    from mlflow.tracking import MlflowClient

    from shardline.training import job as training_job

    monkeypatch.setattr(training_job, "check_steps", lambda *a: None)  # a hole in preflight
    cfg = TrainingConfig(launcher="local", world_size=2, epochs=2, data_wait_warning=0.0,
                         data_wait_warning_min_s=0.0, data_wait_warning_min_steps=0)
    tracking = TrackingConfig(experiment="defaults", registered_model="defaults-untrained")
    with pytest.raises(ShardlineError, match=r"took 0 optimizer steps in 2 epoch\(s\).*not logged or registered"):
        run_training(cfg, tracking, small_dataset.dataset_dir, LocalEngine())
    client = MlflowClient(tracking_uri)
    assert client.search_model_versions("name='defaults-untrained'") == []
    runs = client.search_runs([client.get_experiment_by_name("defaults").experiment_id],
                              "attributes.status = 'FAILED'")
    assert runs and "model" not in {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    err = capfd.readouterr().err
    assert "waited for data" not in err, err


# -- item 7: checkpoints per job ----------------------------------------------------------


def test_default_checkpoint_dir_is_per_job(tmp_path):
    def resolved(*sets: str) -> str:
        cfg = load_config(None, ["tracking.experiment='exp one'", *sets])
        return resolve_paths(cfg, ["local"], ()).training.checkpoint_dir

    a = resolved()
    assert a == resolved()  # the same job finds its own again (--resume)
    assert Path(a).parent == Path.cwd() / "shardline-data" / "checkpoints" / "exp_one"
    assert Path(a).name.startswith("shardline-model-")
    assert len({a, resolved("training.hidden=[32]"), resolved("pipelines.dataset_dir='other'"),
                resolved("tracking.registered_model='m2'")}) == 4
    # Set, it is used as it is.
    assert resolved(f"training.checkpoint_dir='{tmp_path}/mine'") == f"{tmp_path}/mine"


def test_a_job_never_deletes_another_jobs_checkpoints(small_dataset, tmp_path):
    shared = str(tmp_path / "shared")
    theirs = TrainingConfig(launcher="local", batch_size=64, hidden=[16], checkpoint_dir=shared)
    fp = fingerprint.fingerprint(theirs, "v-old")
    saved = CheckpointStore(shared).save(7, {"fingerprint": fp, "run_id": ""}, keep=3)

    mine = theirs.model_copy(update={"hidden": [32]})
    with pytest.raises(DataError, match=r"holds another job's checkpoints \(hidden '\[16\]' \(this job: '\[32\]'\)\)"):
        run_training(mine, TrackingConfig(), small_dataset.dataset_dir, LocalEngine())
    assert CheckpointStore(shared).latest() == saved and Path(saved).exists()  # untouched

    # The same job again (on another dataset version) clears its own.
    CheckpointStore(shared).start_over(fingerprint.fingerprint(theirs, "v-new"))
    assert CheckpointStore(shared).latest() is None and not Path(saved).exists()


def test_a_pointer_without_fingerprint_falls_back_to_the_checkpoint(tmp_path):
    d = str(tmp_path / "old")
    theirs = fingerprint.fingerprint(TrainingConfig(hidden=[16]), "v")
    CheckpointStore(d).save(1, {"fingerprint": theirs}, keep=3)
    (tmp_path / "old" / POINTER).write_text('{"name": "%s", "step": 1}'
                                                        % Path(CheckpointStore(d).latest()).name)
    assert CheckpointStore(d).owner() == theirs
    with pytest.raises(DataError, match="another job's"):
        CheckpointStore(d).start_over(fingerprint.fingerprint(TrainingConfig(hidden=[8]), "v"))


# -- item 5: the exit-code table ----------------------------------------------------------


def test_exit_code_table_matches_the_errors():
    assert EXIT_CODES.keys() == {0, 1, 2, 75, 130}
    text = (REPO / "docs" / "reference" / "errors.md").read_text()
    table = text.split("## Exit codes", 1)[1].split("\n\n", 2)[1]
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| `?(\d+)`? \|(.*)$", table, re.M)}
    assert rows.keys() == EXIT_CODES.keys(), rows
    assert ConfigError.exit_code == 2 and "ConfigError" in rows[2]
    assert ShardlineError.exit_code == DataError.exit_code == 1 and "DataError" in rows[1]
    assert LeaseHeld.exit_code == 75 and "LeaseHeld" in rows[75]
    # A refused --resume is 2 whatever the checkpoint refuses it for (#53 item 12).
    assert fingerprint.ResumeRefused.exit_code == 2 and "ResumeRefused" in rows[2]


@pytest.mark.slow  # the CLI in a subprocess
def test_exit_codes_from_the_cli(small_dataset, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    config = _config(tmp_path, small_dataset.dataset_dir)
    bad_setting = shardline("train", str(config), "--set", "training.epochz=3", cwd=work)
    assert bad_setting.returncode == 2 and "unknown setting 'training.epochz'" in bad_setting.stderr
    usage = shardline("train", str(config), "--world-size", "two", cwd=work)
    assert usage.returncode == 2 and "--world-size" in usage.stderr
    refused = shardline("train", str(config), cwd=work)
    assert refused.returncode == 1 and "0 optimizer steps" in refused.stderr
    assert list(work.iterdir()) == []
