"""Hyperparameter sweeps: Optuna proposes, trials train P at a time as MLflow child runs.

The driver alone asks Optuna for trials and tells it their outcome (study.ask /
study.tell). Each trial is one training job (training.job.run_training) started
from a driver thread: a barrier stage on Spark, pinned futures on Dask, processes
locally. Rank 0 of each trial reports every epoch's objective to the study and asks
the pruner whether to go on, so the study lives in an RDB storage (SQLite by
default) that the trial's process can open too. That storage is also what makes a
sweep resumable: started again under the same name, it continues the same study.

A pruner's "step" is the number of epochs a trial has trained (1 after its first
epoch): the resource successive halving and Hyperband count. MLflow's epoch
metrics keep their 0-based epoch as step, like any training run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardline.foundation.storage import resolve as resolve_path
from shardline.foundation.errors import ConfigError, DataError, ShardlineError
from shardline.foundation.redact import redact

from ..config import TrackingConfig, TrainingConfig
from ..job import check_engine, preflight
from ..task import metric_names, task_of, user_metric_names
from .config import SweepConfig, with_setting
from .report import TrialOutcome, log_summary, outcome, register_best
from .study import distribution, grid, make_pruner, make_sampler, open_storage, resolve_storage
from .trials import Trials, close_interrupted, counts, run_trials, say
from ..tracking import open_experiment

# Imported inside the functions that use them: Optuna (only in a sweep); MLflow (~2.5 s: only where MLflow is
# called).

# The per-epoch metrics shardline's own loop logs (training/loop/builtin.py); val_* need a val split
# with at least one shard per rank.
# Classification's; regression logs train_/val_ loss, rmse, mae and r2 instead (training.task).
EPOCH_METRICS = ("train_loss", "train_accuracy", "samples_per_s", "data_wait_fraction")


@dataclass
class SweepResult:
    name: str
    storage: str
    parent_run_id: str
    objective: str
    direction: str
    trials: list[TrialOutcome]  # every trial of the study, this run's and earlier ones
    ran: int  # trials run by this call
    best: TrialOutcome | None
    model_uri: str | None  # models:/<name>@<alias>, None when no trial completed
    model_version: str | None

    def count(self, state: str) -> int:
        return sum(t.state == state for t in self.trials)


# ---------------------------------------------------------------- checks, before anything starts


def trial_base(sweep: SweepConfig, training: TrainingConfig) -> TrainingConfig:
    """The training config every trial starts from."""
    engine = sweep.engine or training.launcher
    return TrainingConfig.model_validate(
        {**training.model_dump(), "launcher": engine, "world_size": sweep.world_size, "resume": False}
    )


def check_sweep(sweep: SweepConfig, training: TrainingConfig, dataset_dir: str) -> None:
    """Every check that needs no engine: the space, the objective, each value's trainability."""
    if not sweep.space:
        raise ConfigError(
            "sweep.space is empty: name at least one training setting to search, "
            "e.g. sweep.space.lr = {type = \"float\", low = 1e-4, high = 0.1, log = true}"
        )
    base = trial_base(sweep, training)
    manifest = preflight(base, dataset_dir)
    kind = task_of(manifest)
    produced = [*metric_names(kind, "train"), *EPOCH_METRICS[2:]]
    val = manifest.splits.get("val")
    if val is not None and len(val.shards) >= base.world_size:
        produced += metric_names(kind, "val") + user_metric_names(base)
    if sweep.objective not in produced:
        raise ConfigError(
            f"sweep.objective: training does not produce '{sweep.objective}' on this dataset "
            f"(it produces: {', '.join(produced)})"
        )
    # Each edge value alone must train; combinations are the trials' business.
    for name, space in sweep.space.items():
        for value in space.values_to_check():
            try:
                preflight(TrainingConfig.model_validate(with_setting(base.model_dump(), name, value)), dataset_dir)
            except (ConfigError, DataError) as e:
                raise ConfigError(f"sweep.space.{name}: {value!r} cannot train: {e}") from None
    if sweep.sampler == "grid":
        grid(sweep.space)


def check_parallel(sweep: SweepConfig, base: TrainingConfig, engine) -> list[list[str]] | None:
    """Refuse more parallel trials than `engine` (sweep.engine's: shardline.engines.base.
    Engine) runs at once; each trial's group of workers when the engine pins ranks to them."""
    check_engine(base, engine)
    ws = base.world_size
    slots = engine.slots(base.threads_per_rank)
    if slots.count is None:  # nothing bounds the cluster: the engine's own check decides
        return None
    trials = slots.count // (ws * slots.per_rank)
    if sweep.parallel > trials:
        raise ConfigError(
            f"sweep.parallel {sweep.parallel} is more than the {trials} trial(s) of "
            f"{ws} rank(s) that the {slots.where} can run at once"
        )
    if slots.workers:
        return [list(slots.workers[i * ws : (i + 1) * ws]) for i in range(sweep.parallel)]
    return None


# ---------------------------------------------------------------- the sweep


def run_sweep(
    sweep: SweepConfig,
    training: TrainingConfig,
    tracking: TrackingConfig,
    dataset_dir: str,
    engine,
) -> SweepResult:
    """Run (or resume) the sweep `sweep.name` until it holds `sweep.trials` finished trials,
    each a training job on `engine` (sweep.engine's, else training.launcher's)."""
    from mlflow.tracking import MlflowClient

    dataset_dir = resolve_path(dataset_dir, "pipelines.dataset_dir")
    training = training.model_copy(
        update={"checkpoint_dir": resolve_path(training.checkpoint_dir, "training.checkpoint_dir")}
    )
    check_sweep(sweep, training, dataset_dir)
    base = trial_base(sweep, training)
    groups = check_parallel(sweep, base, engine)
    uri = tracking.resolved_uri()
    experiment_id = open_experiment(uri, tracking.experiment)
    client = MlflowClient(uri)
    storage_url = resolve_storage(sweep, uri)
    direction = sweep.resolved_direction()
    searched = sweep.space.get("epochs")
    max_epochs = max([base.epochs, *(int(v) for v in searched.values_to_check())] if searched else [base.epochs])

    storage, study = _open_study(sweep, storage_url, direction, max_epochs)
    parent = _parent_run(client, study, experiment_id, sweep, direction, storage_url, dataset_dir)
    close_interrupted(study, storage, client, parent)

    dists = {name: distribution(s) for name, s in sweep.space.items()}
    todo = _to_run(study, sweep, base, storage_url)
    trials = Trials(sweep, base, tracking, dataset_dir, engine, client, experiment_id, parent, storage_url,
                    max_epochs)
    try:
        started = run_trials(study, dists, todo, groups, trials)
    except KeyboardInterrupt:
        # Close the running trials now, as a resume would (their processes end with this one).
        close_interrupted(study, storage, client, parent)
        client.set_terminated(parent, "KILLED")
        say(f"sweep '{sweep.name}' interrupted: run it again with the same name to resume")
        raise
    return _finish(study, client, parent, sweep, tracking, direction, storage_url, started)


def _open_study(sweep: SweepConfig, storage_url: str, direction: str, max_epochs: int):
    """The sweep's Optuna storage and study, created or loaded (a resume), with a sampler."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(storage_url)
    study = optuna.create_study(
        study_name=sweep.name,
        storage=storage,
        direction=direction,
        pruner=make_pruner(sweep, max_epochs),
        load_if_exists=True,
    )
    _check_same_study(study, sweep, direction)
    # A fresh seed per resume: the same seed would propose the first trials again.
    study.sampler = make_sampler(sweep, sweep.seed + len(study.trials))
    return storage, study


def _to_run(study, sweep: SweepConfig, base: TrainingConfig, storage_url: str) -> int:
    """How many trials this call runs: sweep.trials (at most the grid's points) less those done; said."""
    target = sweep.trials
    if sweep.sampler == "grid":
        size = math.prod(len(v) for v in grid(sweep.space).values())
        if target > size:
            say(f"the grid has {size} points: sweep.trials {target} capped to {size}")
            target = size
    done = sum(1 for t in study.get_trials(deepcopy=False) if counts(t))
    todo = max(0, target - done)
    say(
        f"sweep '{sweep.name}': {done} trial(s) done, {todo} to run, {sweep.parallel} at a time "
        f"on {base.launcher} ({base.world_size} rank(s) each); study in {redact(storage_url)}"
    )
    return todo


def _finish(study, client, parent: str, sweep: SweepConfig, tracking: TrackingConfig, direction: str,
            storage_url: str, started: int) -> SweepResult:
    """The sweep's outcome: the best trial's model registered, the summary logged, the parent run ended
    (FAILED, and ShardlineError, when every trial counted failed)."""
    trials = study.get_trials(deepcopy=False)
    outcomes = [outcome(t) for t in trials]
    counted = [o for t, o in zip(trials, outcomes) if counts(t)]
    complete = [t for t in outcomes if t.state == "complete"]
    best = version = model_uri = None
    if complete:
        best = outcome(study.best_trial)
        version = register_best(client, tracking.registered_model, sweep.alias, best.run_id)
        model_uri = f"models:/{tracking.registered_model}@{sweep.alias}"
    log_summary(client, parent, study, outcomes, sweep, direction, best)
    if counted and all(t.state == "failed" for t in counted):
        client.set_terminated(parent, "FAILED")
        raise ShardlineError(
            f"sweep '{sweep.name}': all {len(counted)} trial(s) failed; "
            f"trial {counted[0].number}: {counted[0].error}"
        )
    client.set_terminated(parent, "FINISHED")
    return SweepResult(
        sweep.name, storage_url, parent, sweep.objective, direction, outcomes, started, best,
        model_uri, version,
    )


def _check_same_study(study, sweep: SweepConfig, direction: str) -> None:
    had = study.user_attrs.get("objective")
    if had is None:
        study.set_user_attr("objective", sweep.objective)
        return
    if had != sweep.objective or study.direction.name.lower() != direction:
        raise ConfigError(
            f"sweep.objective: sweep '{sweep.name}' already optimises {had} "
            f"({study.direction.name.lower()}); give a new objective a new --name"
        )


def _parent_run(client, study, experiment_id, sweep, direction, storage_url, dataset_dir) -> str:
    """The sweep's parent run: the study's own when resuming, else a new one."""
    from mlflow.exceptions import MlflowException

    run_id = study.user_attrs.get("mlflow_parent_run_id")
    if run_id:
        try:
            if client.get_run(run_id).info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
            return run_id
        except MlflowException:
            pass  # another tracking store: a new parent run
    run_id = client.create_run(
        experiment_id, run_name=f"sweep {sweep.name}", tags={"shardline.sweep": sweep.name}
    ).info.run_id
    client.log_batch(
        run_id,
        params=_params(
            {
                "objective": sweep.objective,
                "direction": direction,
                "sampler": sweep.sampler,
                "pruner": sweep.pruner,
                "world_size": sweep.world_size,
                "storage": redact(storage_url),
                "dataset_dir": dataset_dir,
                **{f"space.{n}": s.model_dump_json(exclude_none=True) for n, s in sweep.space.items()},
            }
        ),
        synchronous=True,
    )
    study.set_user_attr("mlflow_parent_run_id", run_id)
    return run_id


def _params(d: dict):
    from mlflow.entities import Param

    return [Param(k, str(v)) for k, v in d.items()]
