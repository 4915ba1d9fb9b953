"""Sweeps: real Optuna studies in SQLite, real trials on each engine, real MLflow child runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.engines import DaskEngine, LocalEngine, SparkEngine
from shardline.foundation.errors import ShardlineError
from shardline.pipelines.manifest import load_manifest
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.sweeps.run import EPOCH_METRICS, run_sweep

VAL_METRICS = ("val_loss", "val_accuracy")  # what a classification run with a val split logs
from shardline.training.sweeps.config import SweepConfig

from .conftest import shardline_here
from .mlflow_store import env_without_store


def sweep_config(name: str, space: dict, **kw) -> SweepConfig:
    return SweepConfig.model_validate({"name": name, "space": space, **kw})


def small_training(tmp_path: Path, **kw) -> TrainingConfig:
    return TrainingConfig(**{"epochs": 1, "batch_size": 128, "checkpoint_dir": str(tmp_path / "ckpt"), **kw})


def children(client, parent_run_id: str) -> dict[str, object]:
    """The parent's child runs, by trial number."""
    exp = client.get_run(parent_run_id).info.experiment_id
    runs = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return {int(r.data.tags["trial_number"]): r for r in runs}


@pytest.mark.slow
def test_local_sweep_runs_trials_side_by_side_records_a_failure_registers_the_best(
    prepared, tracking_uri, tmp_path
):
    from mlflow.tracking import MlflowClient

    # heads 3 does not divide the transformer's width 16: that one trial fails at its start.
    sweep = sweep_config(
        "local-grid",
        {
            "model": {"type": "categorical", "choices": ["mlp", "transformer"]},
            "heads": {"type": "categorical", "choices": [3, 4]},
        },
        engine="local", sampler="grid", pruner="none", trials=4, parallel=2,
    )  # fmt: skip
    training = small_training(tmp_path, hidden=[16])
    tracking = TrackingConfig(experiment="sweep-local", registered_model="sweep-local")
    result = run_sweep(sweep, training, tracking, prepared.dataset_dir, LocalEngine())

    states = {(t.params["model"], t.params["heads"]): t.state for t in result.trials}
    assert states == {
        ("mlp", 3): "complete", ("mlp", 4): "complete",
        ("transformer", 3): "failed", ("transformer", 4): "complete",
    }  # fmt: skip
    failed = next(t for t in result.trials if t.state == "failed")
    assert "must be divisible by training.heads 3" in failed.error

    client = MlflowClient(tracking_uri)
    runs = children(client, result.parent_run_id)
    assert sorted(runs) == [0, 1, 2, 3]
    for t in result.trials:
        run = runs[t.number]
        assert run.info.run_id == t.run_id and run.data.tags["trial_state"] == t.state
        if t.state == "complete":
            assert run.info.status == "FINISHED"
            assert run.data.params["model"] == t.params["model"]
            assert run.data.params["heads"] == str(t.params["heads"])
            # The objective list the sweep checks against is what training really logs.
            assert set(EPOCH_METRICS + VAL_METRICS) <= set(run.data.metrics)
            assert run.data.metrics["val_accuracy"] == pytest.approx(t.value)
    assert runs[failed.number].info.status == "FAILED"
    assert runs[failed.number].data.tags["trial_error"] == failed.error

    complete = [t for t in result.trials if t.state == "complete"]
    assert result.best.value == max(t.value for t in complete)
    best_version = client.get_model_version_by_alias("sweep-local", "best")
    assert best_version.run_id == result.best.run_id
    # Only the best trial's model is registered.
    assert [v.version for v in client.search_model_versions("name='sweep-local'")] == [best_version.version]

    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials_failed"] == 1
    artifacts = {a.path for a in client.list_artifacts(result.parent_run_id, "sweep")}
    assert artifacts == {"sweep/trials.csv", "sweep/trials.md", "sweep/sweep.png"}
    table = Path(client.download_artifacts(result.parent_run_id, "sweep/trials.csv", str(tmp_path)))
    lines = table.read_text().splitlines()
    assert lines[0].startswith("trial,state,val_accuracy,epochs") and len(lines) == 5


def test_pruning_stops_a_weak_trial_after_its_first_epoch(prepared, tracking_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    # Grid order under seed 1: lr 0.01 first (completes), then lr 1e-6, far below the
    # median of completed trials after epoch 1.
    sweep = sweep_config(
        "prune",
        {"lr": {"type": "categorical", "choices": [0.01, 1e-6]}},
        engine="local", sampler="grid", pruner="median", pruner_startup_trials=1,
        pruner_warmup_epochs=0, trials=2, parallel=1, seed=1,
    )  # fmt: skip
    training = small_training(tmp_path, epochs=3)
    tracking = TrackingConfig(experiment="sweep-prune", registered_model="sweep-prune")
    result = run_sweep(sweep, training, tracking, prepared.dataset_dir, LocalEngine())

    first, second = result.trials
    assert (first.params["lr"], first.state, first.epochs) == (0.01, "complete", 3)
    assert (second.params["lr"], second.state, second.epochs) == (1e-6, "pruned", 1)
    client = MlflowClient(tracking_uri)
    for t, epochs in ((first, 3), (second, 1)):
        history = client.get_metric_history(t.run_id, "val_accuracy")
        assert [m.step for m in history] == list(range(epochs))
    assert client.get_run(second.run_id).data.tags["trial_state"] == "pruned"
    assert client.get_model_version_by_alias("sweep-prune", "best").run_id == first.run_id
    # Runs named for what they are: the sweep, and each trial of it.
    assert [client.get_run(t.run_id).info.run_name for t in (first, second)] == \
        ["sweep prune trial 0", "sweep prune trial 1"]
    parent = client.get_run(first.run_id).data.tags["mlflow.parentRunId"]
    assert client.get_run(parent).info.run_name == "sweep prune"


@pytest.mark.parametrize("pruner", ["median", "halving", "hyperband"])
def test_each_pruner_stops_trials_reporting_worse_than_their_peers(tmp_path, pruner):
    """The epoch hook as rank 0 runs it (pickled, its own study handle) against a real study."""
    import pickle

    import optuna
    from optuna.trial import TrialState

    from shardline.training.sweeps.study import PruningReporter, make_pruner, open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    epochs = 4
    sweep = sweep_config(
        "pruners", {"lr": {"type": "float", "low": 1e-3, "high": 1e-2}},
        pruner=pruner, pruner_startup_trials=1, pruner_warmup_epochs=0,
    )  # fmt: skip
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(
        study_name="pruners", storage=open_storage(url), direction="maximize",
        pruner=make_pruner(sweep, epochs),
    )  # fmt: skip

    def epochs_trained(accuracy: float) -> int:
        trial = study.ask()
        hook = PruningReporter(url, "pruners", trial._trial_id, "val_accuracy", sweep, epochs)
        hook = pickle.loads(pickle.dumps(hook))
        for epoch in range(epochs):
            if hook(epoch, {"val_accuracy": accuracy}):
                study.tell(trial, state=TrialState.PRUNED)
                return epoch + 1
        study.tell(trial, accuracy)
        return epochs

    good = [epochs_trained(0.5 + 0.05 * i) for i in range(6)]  # each the best so far
    weak = [epochs_trained(0.1) for _ in range(6)]
    assert good == [epochs] * 6
    # Median and halving judge after every epoch; Hyperband at its bracket's rungs (1 or 3 here).
    assert all(n in ({1, 3} if pruner == "hyperband" else {1}) for n in weak), weak


def test_a_trial_whose_rank_crashes_is_recorded_failed_and_the_sweep_goes_on(prepared, tracking_uri, tmp_path):
    import threading

    from mlflow.tracking import MlflowClient

    sweep = sweep_config(
        "crash", {"lr": {"type": "categorical", "choices": [0.01, 0.003]}},
        engine="local", sampler="grid", pruner="none", trials=2, parallel=1,
    )  # fmt: skip
    # No relaunch: the killed rank fails its trial at once.
    training = small_training(tmp_path, epochs=3, max_restarts=0)
    tracking = TrackingConfig(experiment="sweep-crash", registered_model="sweep-crash")
    announced = tmp_path / "ckpt" / "sweeps" / "crash" / "trial-0" / "ranks" / "rank-0.json"
    stop = threading.Event()

    def kill_trial_0() -> None:  # SIGKILL trial 0's rank as soon as it says who it is
        while not stop.is_set():
            if announced.exists():
                os.kill(json.loads(announced.read_text())["pid"], signal.SIGKILL)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_trial_0, daemon=True)
    killer.start()
    try:
        result = run_sweep(sweep, training, tracking, prepared.dataset_dir, LocalEngine())
    finally:
        stop.set()
        killer.join()

    crashed, fine = result.trials
    assert crashed.state == "failed" and "rank 0 on " in crashed.error and "killed by SIGKILL (exit code -9)" in crashed.error, crashed.error
    assert fine.state == "complete" and result.best.number == fine.number
    client = MlflowClient(tracking_uri)
    run = client.get_run(crashed.run_id)
    assert run.info.status == "FAILED" and run.data.tags["trial_error"] == crashed.error
    assert client.get_model_version_by_alias("sweep-crash", "best").run_id == fine.run_id


def test_spark_sweep_runs_each_trial_as_a_two_rank_barrier_stage(prepared, spark, tracking_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    space = {"lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}
    training = small_training(tmp_path)
    tracking = TrackingConfig(experiment="sweep-spark", registered_model="sweep-spark")
    too_many = sweep_config("spark-2x2", space, engine="spark", world_size=2, parallel=2)
    with pytest.raises(ShardlineError, match=r"sweep.parallel 2 is more than the 1 trial\(s\) of 2 rank\(s\) that the 2 task slots"):
        run_sweep(too_many, training, tracking, prepared.dataset_dir, engine=SparkEngine(spark))

    sweep = sweep_config("spark-2x1", space, engine="spark", world_size=2, parallel=1, trials=2)
    result = run_sweep(sweep, training, tracking, prepared.dataset_dir, engine=SparkEngine(spark))
    assert [t.state for t in result.trials] == ["complete", "complete"]
    client = MlflowClient(tracking_uri)
    for t in result.trials:
        run = client.get_run(t.run_id)
        assert run.data.params["launcher"] == "spark" and run.data.params["world_size"] == "2"
        assert {"rank0_samples_per_s", "rank1_samples_per_s"} <= set(run.data.metrics)
        assert 1e-3 <= t.params["lr"] <= 1e-2
    assert result.model_uri == "models:/sweep-spark@best"


def test_dask_sweep_runs_concurrent_trials_on_different_workers(prepared, dask_client, tmp_path):
    space = {"lr": {"type": "float", "low": 1e-3, "high": 1e-2}}
    training = small_training(tmp_path)
    tracking = TrackingConfig(experiment="sweep-dask", registered_model="sweep-dask")
    too_many = sweep_config("dask-3", space, engine="dask", parallel=3)
    with pytest.raises(ShardlineError, match=r"sweep.parallel 3 is more than the 2 trial\(s\) of 1 rank\(s\) that the 2 Dask workers"):
        run_sweep(too_many, training, tracking, prepared.dataset_dir, engine=DaskEngine(dask_client))

    sweep = sweep_config("dask-2", space, engine="dask", parallel=2, trials=2)
    result = run_sweep(sweep, training, tracking, prepared.dataset_dir, engine=DaskEngine(dask_client))
    assert [t.state for t in result.trials] == ["complete", "complete"]
    # Each rank announces its process; two trials at once must not share a worker.
    pids = {
        json.loads((tmp_path / "ckpt" / "sweeps" / "dask-2" / f"trial-{n}" / "ranks" / "rank-0.json").read_text())["pid"]
        for n in (0, 1)
    }
    assert len(pids) == 2


def write_config(tmp_path: Path, prepared, extra: str = "") -> Path:
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(
        f"""
[pipelines]
dataset_dir = "{prepared.dataset_dir}"

[training]
epochs = 2
batch_size = 128
checkpoint_dir = "{tmp_path / 'ckpt'}"

[tracking]
experiment = "sweep-cli"
registered_model = "sweep-cli"

[sweep]
engine = "local"
pruner = "none"
{extra}
"""
    )
    return cfg


LR_SPACE = """
[sweep.space.lr]
type = "float"
low = 1e-3
high = 3e-2
log = true
"""


def study_trials(db, name: str):
    """The study's trials ([] before it exists); `db`: its SQLite file, or an Optuna storage open on it."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{db}" if isinstance(db, Path) else db
    try:
        return optuna.load_study(study_name=name, storage=storage).get_trials()
    except KeyError:  # not created yet
        return []


@pytest.mark.slow
def test_killed_sweep_resumes_without_rerunning_completed_trials_and_best_scores(prepared, on_session_dask,
                                                                                tmp_path):
    cfg = write_config(tmp_path, prepared, LR_SPACE)
    db = tmp_path / "mlflow-optuna.db"  # beside the default tracking store, ./mlflow.db
    cmd = [sys.executable, "-m", "shardline.jobs.cli", "sweep", str(cfg), "--trials", "2", "--parallel", "1", "--name", "resume"]
    env = env_without_store()
    log = tmp_path / "sweep.log"
    import optuna

    # One storage for every poll (opening one costs ~40 ms of CPU, a poll with it ~4 ms). It
    # creates the empty study tables, as the first poll did in effect: seconds before the
    # sweep, still importing then, got to its storage.
    polled = optuna.storages.RDBStorage(f"sqlite:///{db}")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    states: list[str] = []
    try:
        deadline = time.monotonic() + 600  # generous: it ends as soon as the state is reached
        while time.monotonic() < deadline and proc.poll() is None:
            trials = study_trials(polled, "resume")
            states = [t.state.name for t in trials]
            # Kill once the second trial's MLflow run exists: on a loaded machine the
            # trial can be RUNNING in the study a while before its run is opened.
            if states == ["COMPLETE", "RUNNING"] and "mlflow_run_id" in trials[1].user_attrs:
                break
            time.sleep(0.2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its trial's processes
        except ProcessLookupError:  # it ended by itself: the assertion below says how
            pass
        proc.wait()
        polled.engine.dispose()
    assert states == ["COMPLETE", "RUNNING"], (
        f"sweep never reached its second trial: {states}, exit {proc.returncode}\n{log.read_text()[-2000:]}"
    )
    before = study_trials(db, "resume")

    # The rest in this process (shardline_here): the kill above is what needed a process.
    done = shardline_here(*cmd[3:], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 trial(s) done, 1 to run" in done.stderr
    after = study_trials(db, "resume")
    assert [t.state.name for t in after] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert after[0].datetime_complete == before[0].datetime_complete  # not run again
    assert after[1].user_attrs["error"].startswith("interrupted")
    assert after[2].params == after[1].params  # the interrupted point is tried again

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = after[0].user_attrs["mlflow_run_id"]
    parent = client.get_run(parent).data.tags["mlflow.parentRunId"]
    runs = children(client, parent)
    assert [runs[n].info.status for n in (0, 1, 2)] == ["FINISHED", "KILLED", "FINISHED"]

    sweeps = client.search_runs([runs[0].info.experiment_id], "tags.`shardline.sweep` = 'resume'")
    assert [r.info.run_id for r in sweeps if "mlflow.parentRunId" not in r.data.tags] == [parent]

    # On the session's Dask cluster (a LocalCluster of its own would start and load the
    # model afresh); a scheduler's workers may be on other hosts: absolute paths only.
    scored = shardline_here(
        "score", str(cfg), "--model", "models:/sweep-cli@best", "--engine", "dask",
        "--output", str(tmp_path / "scores"), *on_session_dask,
        "--set", f"pipelines.source.path='{tmp_path / 'raw'}'", cwd=tmp_path,
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-2000:]
    test_rows = load_manifest(prepared.dataset_dir).splits["test"].rows
    assert f"{test_rows:,} rows from" in scored.stderr


def test_every_trial_failing_exits_non_zero(prepared, tmp_path):
    # Each value trains alone (checked up front); together they cannot: d_model 16 % heads.
    cfg = write_config(
        tmp_path,
        prepared,
        'sampler = "grid"\n'
        '[sweep.space.model]\ntype = "categorical"\nchoices = ["transformer"]\n'
        '[sweep.space.heads]\ntype = "categorical"\nchoices = [3, 5]\n',
    )
    r = shardline_here("sweep", str(cfg), "--set", "training.hidden=[16]", "--name", "all-fail", cwd=tmp_path)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sweep 'all-fail': all 2 trial(s) failed; trial 0:"), r.stderr[-2000:]


@pytest.mark.parametrize(
    "extra, args, message",
    [
        ("", [], r"sweep.space is empty: name at least one training setting to search, e.g. sweep.space.lr = "),
        ('[sweep.space.lr]\ntype = "float"\nlow = 0.1\nhigh = 0.001\n', [],
         r"sweep.space.lr: low 0.1 is greater than high 0.001$"),
        ('[sweep.space.lr]\ntype = "float"\nlow = 0.0\nhigh = 0.1\nlog = true\n', [],
         r"sweep.space.lr: log scale needs low > 0 \(got low 0\)$"),
        ('[sweep.space.dropout]\ntype = "float"\nlow = 0.0\nhigh = 0.5\n', [],
         r"sweep.space: 'dropout' is not a searchable training setting \(valid: .*lr, "),
        ('[sweep.space.lr]\ntype = "float"\nlow = 0.001\nhigh = 0.1\n', ["--set", "sweep.sampler='grid'"],
         r"sweep.space.lr: the grid sampler needs `step` on a float"),
        (LR_SPACE, ["--set", "sweep.objective='val_f1'"],
         r"sweep.objective: training does not produce 'val_f1' on this dataset \(it produces: "
         r"train_loss, train_accuracy, samples_per_s, data_wait_fraction, val_loss, val_accuracy\)$"),
        (LR_SPACE, ["--parallel", "0"], r"sweep.parallel: Input should be greater than or equal to 1 \(got 0\)$"),
        (LR_SPACE, ["--parallel", "-3"], r"sweep.parallel: Input should be greater than or equal to 1 \(got -3\)$"),
        (LR_SPACE, ["--parallel", "1000"],
         r"sweep.parallel 1000 is more than the \d+ trial\(s\) of 1 rank\(s\) that the \d+ cores of this machine can run at once$"),
        ('[sweep.space.epochs]\ntype = "int"\nlow = 5\nhigh = 1\n', [], r"sweep.space.epochs: low 5 is greater than high 1$"),
        ('[sweep.space.hidden]\ntype = "categorical"\nchoices = [64]\n', [],
         r"sweep.space: hidden: training.hidden takes a list, got 64$"),
    ],
    ids=["empty", "low>high", "log<=0", "unknown-param", "grid-float", "objective", "parallel-0", "parallel-neg",
         "parallel-too-many", "int-low>high", "wrong-kind"],
)
def test_bad_input_is_one_line_exit_2_and_starts_nothing(prepared, tmp_path, monkeypatch, capsys, extra, args, message):
    import re

    from shardline.jobs.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    cfg = write_config(tmp_path, prepared, extra)
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(cfg), *args])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.toml"]  # no store, no study, no checkpoints
