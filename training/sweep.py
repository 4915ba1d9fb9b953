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

import json
import math
import os
import queue
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.storage import join as join_url, resolve as resolve_path
from pipelines.errors import ConfigError, DataError, ShardlineError

from .config import TrackingConfig, TrainingConfig
from .job import preflight, run_training
from .task import metric_names, task_of
from .sweep_config import ParamSpace, SweepConfig
from .tracking import open_experiment

# The per-epoch metrics train_rank logs (training/worker.py); val_* need a val split
# with at least one shard per rank.
# Classification's; regression logs train_/val_ loss, rmse, mae and r2 instead (training.task).
EPOCH_METRICS = ("train_loss", "train_accuracy", "samples_per_s", "data_wait_fraction")
VAL_METRICS = ("val_loss", "val_accuracy")


@dataclass
class TrialOutcome:
    number: int
    state: str  # complete | pruned | failed | running | waiting
    value: float | None  # objective: final for complete, last reported for pruned
    params: dict
    epochs: int  # epochs reported to the pruner
    run_id: str | None
    error: str | None
    seconds: float | None


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
        produced += metric_names(kind, "val")
    if sweep.objective not in produced:
        raise ConfigError(
            f"sweep.objective: training does not produce '{sweep.objective}' on this dataset "
            f"(it produces: {', '.join(produced)})"
        )
    # Each edge value alone must train; combinations are the trials' business.
    for name, space in sweep.space.items():
        for value in space.values_to_check():
            try:
                preflight(base.model_copy(update={name: value}), dataset_dir)
            except (ConfigError, DataError) as e:
                raise ConfigError(f"sweep.space.{name}: {value!r} cannot train: {e}") from None
    if sweep.sampler == "grid":
        _grid(sweep.space)
    if base.launcher == "local":  # the other engines' slots are known once they run
        check_parallel(sweep, base, None, None)


def check_parallel(sweep: SweepConfig, base: TrainingConfig, spark, dask_client) -> list[list[str]] | None:
    """Refuse more parallel trials than the engine runs at once; Dask: a worker group per trial."""
    ws = base.world_size
    if base.launcher == "spark":
        if spark is None:
            raise ConfigError("sweep.engine 'spark' needs a Spark session")
        from .launchers.spark import spark_task_slots

        slots = spark_task_slots(spark)
        if slots.count is None:  # nothing bounds the cluster: Spark's barrier check decides
            return None
        total, per_trial = slots.count, ws
        where = f"{total} task slots of {slots.where}"
    elif base.launcher == "dask":
        if dask_client is None:
            raise ConfigError("sweep.engine 'dask' needs a Dask client")
        workers = sorted(dask_client.scheduler_info()["workers"])
        total, per_trial = len(workers), ws
        where = f"{total} Dask workers of {dask_client.scheduler.address}"
    else:
        # The cores this process may use (a container or taskset may give it fewer).
        total = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        per_trial = ws * base.threads_per_rank
        where = f"{total} cores of this machine"
    slots = total // per_trial
    if sweep.parallel > slots:
        raise ConfigError(
            f"sweep.parallel {sweep.parallel} is more than the {slots} trial(s) of "
            f"{ws} rank(s) that the {where} can run at once"
        )
    if base.launcher == "dask":
        return [workers[i * ws : (i + 1) * ws] for i in range(sweep.parallel)]
    return None


def resolve_storage(sweep: SweepConfig, tracking_uri: str) -> str:
    """sweep.storage, else <stem>-optuna.db beside a SQLite tracking store, else ./optuna.db."""
    if sweep.storage:
        return sweep.storage
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///") :])
        return f"sqlite:///{db.with_name(db.stem + '-optuna.db')}"
    return f"sqlite:///{Path.cwd() / 'optuna.db'}"


# ---------------------------------------------------------------- Optuna pieces


def open_storage(url: str):
    from optuna.storages import RDBStorage

    # Concurrent trials write to one SQLite file: wait for its lock rather than fail.
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    try:
        return RDBStorage(url, engine_kwargs=kwargs)
    except Exception as e:  # a bad URL, a missing driver, an unreachable server
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ShardlineError(f"sweep.storage: {url} is not usable ({first[:200]})") from None


def make_pruner(sweep: SweepConfig, max_epochs: int):
    from optuna import pruners

    if sweep.pruner == "median":
        # Steps count epochs done: "never pruned in its first N epochs" is step < N + 1.
        return pruners.MedianPruner(
            n_startup_trials=sweep.pruner_startup_trials, n_warmup_steps=sweep.pruner_warmup_epochs + 1
        )
    if sweep.pruner == "halving":
        return pruners.SuccessiveHalvingPruner(min_resource=1)
    if sweep.pruner == "hyperband":
        return pruners.HyperbandPruner(min_resource=1, max_resource=max_epochs)
    return pruners.NopPruner()


def _make_sampler(sweep: SweepConfig, seed: int):
    from optuna import samplers

    if sweep.sampler == "grid":

        class Grid(samplers.GridSampler):
            # GridSampler calls study.stop() when the grid is done, which only works
            # inside study.optimize; the sweep caps its trials at the grid size itself.
            def after_trial(self, study, trial, state, values) -> None:
                pass

        return Grid(_grid(sweep.space), seed=seed)
    if sweep.sampler == "random":
        return samplers.RandomSampler(seed=seed)
    return samplers.TPESampler(seed=seed)


def _encode(value):
    # Optuna stores scalars only: a list choice (training.hidden) travels as JSON text.
    return json.dumps(value) if isinstance(value, list) else value


def _decode(name: str, value):
    from typing import get_origin

    is_list = get_origin(TrainingConfig.model_fields[name].annotation) is list
    return json.loads(value) if is_list and isinstance(value, str) else value


def _distribution(space: ParamSpace):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if space.type == "categorical":
        return CategoricalDistribution([_encode(c) for c in space.choices])
    if space.type == "int":
        step = int(space.step or 1)
        return IntDistribution(int(space.low), int(space.high), log=space.log, step=step)
    return FloatDistribution(space.low, space.high, log=space.log, step=space.step)


def _grid(spaces: dict[str, ParamSpace]) -> dict[str, list]:
    grid = {}
    for name, s in spaces.items():
        if s.type == "categorical":
            grid[name] = [_encode(c) for c in s.choices]
        elif s.type == "int":
            grid[name] = list(range(int(s.low), int(s.high) + 1, int(s.step or 1)))
        elif s.step is None:
            raise ConfigError(
                f"sweep.space.{name}: the grid sampler needs `step` on a float "
                f"(or type = \"categorical\" with choices)"
            )
        else:
            n = math.floor((s.high - s.low) / s.step + 1e-9) + 1
            grid[name] = [round(s.low + i * s.step, 12) for i in range(n)]
    return grid


@dataclass
class PruningReporter:
    """A trial's epoch hook, run on its rank 0: report the objective, ask the pruner.

    Pickled to the trial's process with the job; opens the study itself there.
    """

    storage_url: str
    study_name: str
    trial_id: int
    objective: str
    sweep: SweepConfig
    max_epochs: int
    _trial: object = field(default=None, init=False, repr=False, compare=False)

    def __call__(self, epoch: int, metrics: dict[str, float]) -> bool:
        if self._trial is None:
            import optuna

            study = optuna.load_study(
                study_name=self.study_name,
                storage=open_storage(self.storage_url),
                sampler=optuna.samplers.RandomSampler(),  # never samples here
                pruner=make_pruner(self.sweep, self.max_epochs),
            )
            self._trial = optuna.trial.Trial(study, self.trial_id)
        self._trial.report(metrics[self.objective], epoch + 1)  # step: epochs done (0-based epoch)
        return self._trial.should_prune()

    def __getstate__(self):
        return {**self.__dict__, "_trial": None}


# ---------------------------------------------------------------- the sweep


def run_sweep(
    sweep: SweepConfig,
    training: TrainingConfig,
    tracking: TrackingConfig,
    dataset_dir: str,
    spark=None,
    dask_client=None,
) -> SweepResult:
    """Run (or resume) the sweep `sweep.name` until it holds `sweep.trials` finished trials."""
    import optuna
    from mlflow.tracking import MlflowClient

    dataset_dir = resolve_path(dataset_dir, "pipelines.dataset_dir")
    training = training.model_copy(
        update={"checkpoint_dir": resolve_path(training.checkpoint_dir, "training.checkpoint_dir")}
    )
    check_sweep(sweep, training, dataset_dir)
    base = trial_base(sweep, training)
    groups = check_parallel(sweep, base, spark, dask_client)
    uri = tracking.resolved_uri()
    experiment_id = open_experiment(uri, tracking.experiment)
    client = MlflowClient(uri)
    storage_url = resolve_storage(sweep, uri)
    direction = sweep.resolved_direction()
    searched = sweep.space.get("epochs")
    max_epochs = max([base.epochs, *(int(v) for v in searched.values_to_check())] if searched else [base.epochs])

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
    study.sampler = _make_sampler(sweep, sweep.seed + len(study.trials))
    parent = _parent_run(client, study, experiment_id, sweep, direction, storage_url, dataset_dir)
    _close_interrupted(study, storage, client, parent)

    dists = {name: _distribution(s) for name, s in sweep.space.items()}
    target = sweep.trials
    if sweep.sampler == "grid":
        size = math.prod(len(v) for v in _grid(sweep.space).values())
        if target > size:
            _say(f"the grid has {size} points: sweep.trials {target} capped to {size}")
            target = size
    done = sum(1 for t in study.get_trials(deepcopy=False) if _counts(t))
    todo = max(0, target - done)
    _say(
        f"sweep '{sweep.name}': {done} trial(s) done, {todo} to run, {sweep.parallel} at a time "
        f"on {base.launcher} ({base.world_size} rank(s) each); study in {storage_url}"
    )

    results: queue.Queue = queue.Queue()
    running: dict[int, tuple] = {}
    free_groups = list(groups) if groups is not None else None
    started = 0
    try:
        while started < todo or running:
            while started < todo and len(running) < sweep.parallel:
                trial = study.ask(dists)
                run_id = client.create_run(
                    experiment_id,
                    run_name=f"sweep {sweep.name} trial {trial.number}",
                    tags={
                        "mlflow.parentRunId": parent,
                        "shardline.sweep": sweep.name,
                        "trial_number": str(trial.number),
                        "trial_state": "running",
                    },
                ).info.run_id
                trial.set_user_attr("mlflow_run_id", run_id)
                group = free_groups.pop() if free_groups is not None else None
                hook = PruningReporter(
                    storage_url, sweep.name, trial._trial_id, sweep.objective, sweep, max_epochs
                )
                params = {n: _decode(n, v) for n, v in trial.params.items()}
                _say(f"trial {trial.number} started: {_fmt(params)}")
                threading.Thread(
                    target=_run_trial,
                    args=(results, trial.number, base, sweep.name, params, tracking, dataset_dir,
                          spark, dask_client, run_id, hook, group),
                    name=f"trial-{trial.number}",
                    daemon=True,  # Ctrl-C ends the sweep now; the study marks the trial interrupted
                ).start()
                running[trial.number] = (trial, run_id, group)
                started += 1
            number, result, error = results.get()
            trial, run_id, group = running.pop(number)
            if group is not None:
                free_groups.append(group)
            _tell(study, trial, run_id, result, error, sweep.objective, client)
    except KeyboardInterrupt:
        # Close the running trials now, as a resume would (their processes end with this one).
        _close_interrupted(study, storage, client, parent)
        client.set_terminated(parent, "KILLED")
        _say(f"sweep '{sweep.name}' interrupted: run it again with the same name to resume")
        raise

    trials = study.get_trials(deepcopy=False)
    outcomes = [_outcome(t) for t in trials]
    counted = [o for t, o in zip(trials, outcomes) if _counts(t)]
    complete = [t for t in outcomes if t.state == "complete"]
    best = version = model_uri = None
    if complete:
        best = _outcome(study.best_trial)
        version = _register_best(client, tracking.registered_model, sweep.alias, best.run_id)
        model_uri = f"models:/{tracking.registered_model}@{sweep.alias}"
    _log_summary(client, parent, study, outcomes, sweep, direction, best)
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


def _run_trial(results, number, base, name, params, tracking, dataset_dir, spark, dask_client,
               run_id, hook, group) -> None:
    """A driver thread: one training job; whatever happens goes back through `results`."""
    try:
        # Its own checkpoint directory: a job deletes stale checkpoints in its own at start.
        ckpt = join_url(base.checkpoint_dir, "sweeps", name, f"trial-{number}")
        cfg = TrainingConfig.model_validate({**base.model_dump(), **params, "checkpoint_dir": ckpt})
        result = run_training(
            cfg, tracking, dataset_dir, spark, dask_client,
            into_run=run_id, register=False, epoch_hook=hook, dask_workers=group,
        )
        results.put((number, result, None))
    except BaseException as e:  # recorded as a failed trial; the sweep goes on
        results.put((number, None, e))


def _tell(study, trial, run_id, result, error, objective, client) -> None:
    from optuna.trial import TrialState

    if error is None and result.stopped_early:
        study.tell(trial, state=TrialState.PRUNED)
        client.set_tag(run_id, "trial_state", "pruned")
        epochs = len(study.get_trials(deepcopy=False)[trial.number].intermediate_values)
        _say(f"trial {trial.number} pruned after epoch {epochs}")
        return
    if error is None and objective not in result.metrics:
        error = ShardlineError(f"training logged no '{objective}'")
    if error is None:
        value = result.metrics[objective]
        study.tell(trial, value)
        client.set_tag(run_id, "trial_state", "complete")
        _say(f"trial {trial.number} complete: {objective} {value:.4g}")
        return
    reason = _reason(error)
    trial.set_user_attr("error", reason)
    study.tell(trial, state=TrialState.FAIL)
    client.set_tag(run_id, "trial_state", "failed")
    client.set_tag(run_id, "trial_error", reason)
    client.set_terminated(run_id, "FAILED")  # also when it failed before training opened it
    _say(f"trial {trial.number} failed: {reason}")


def _reason(e: BaseException) -> str:
    text = str(e) if isinstance(e, ShardlineError) else f"{type(e).__name__}: {e}"
    return (text.strip().splitlines() or [type(e).__name__])[0][:500]


def _counts(t) -> bool:
    """A finished trial counts toward sweep.trials; an interrupted one is run again."""
    return t.state.is_finished() and not t.user_attrs.get("interrupted")


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
                "storage": storage_url,
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


def _close_interrupted(study, storage, client, parent: str) -> None:
    """Trials left running by an interrupted sweep: failed (interrupted), their params queued again."""
    from mlflow.exceptions import MlflowException
    from optuna.trial import TrialState

    # The sweep may have died between creating a child run and recording its id in the
    # study: find the parent's children still running by their trial number too.
    open_children = {}
    try:
        experiment_id = client.get_run(parent).info.experiment_id
        query = f"tags.mlflow.parentRunId = '{parent}' and attributes.status = 'RUNNING'"
        for r in client.search_runs([experiment_id], query):
            open_children[r.data.tags.get("trial_number")] = r.info.run_id
    except MlflowException:
        pass  # another tracking store
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        run_id = t.user_attrs.get("mlflow_run_id") or open_children.get(str(t.number))
        if run_id and "mlflow_run_id" not in t.user_attrs:
            storage.set_trial_user_attr(t._trial_id, "mlflow_run_id", run_id)
        storage.set_trial_user_attr(t._trial_id, "interrupted", True)
        storage.set_trial_user_attr(t._trial_id, "error", "interrupted: the sweep stopped while it ran")
        study.tell(t.number, state=TrialState.FAIL)
        study.enqueue_trial(t.params)
        if run_id:
            try:
                client.set_tag(run_id, "trial_state", "failed")
                client.set_tag(run_id, "trial_error", "interrupted")
                client.set_terminated(run_id, "KILLED")
            except MlflowException:
                pass  # another tracking store
        _say(f"trial {t.number} was interrupted: it runs again")


def _outcome(t) -> TrialOutcome:
    from optuna.trial import TrialState

    state = {
        TrialState.COMPLETE: "complete",
        TrialState.PRUNED: "pruned",
        TrialState.FAIL: "failed",
        TrialState.RUNNING: "running",
        TrialState.WAITING: "waiting",
    }[t.state]
    value = t.value if state == "complete" else None
    if state == "pruned" and t.intermediate_values:
        value = t.intermediate_values[max(t.intermediate_values)]
    seconds = None
    if t.datetime_start and t.datetime_complete:
        seconds = (t.datetime_complete - t.datetime_start).total_seconds()
    return TrialOutcome(
        t.number, state, value, {n: _decode(n, v) for n, v in t.params.items()},
        len(t.intermediate_values), t.user_attrs.get("mlflow_run_id"), t.user_attrs.get("error"),
        seconds,
    )


def _register_best(client, name: str, alias: str, run_id: str) -> str:
    """Register the best trial's logged model and point the alias at it (once per best run)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        current = client.get_model_version_by_alias(name, alias)
        if current.run_id == run_id:
            return str(current.version)
    except MlflowException:
        pass  # no such model or alias yet
    # MLflow 3 keeps a logged model under its own id (models:/m-...), not in the run's artifacts.
    run = client.get_run(run_id)
    logged = client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"
    )
    source = logged[0].model_uri if logged else f"runs:/{run_id}/model"
    version = mlflow.register_model(source, name).version
    client.set_registered_model_alias(name, alias, version)
    return str(version)


# ---------------------------------------------------------------- the summary artifact


def _log_summary(client, parent: str, study, outcomes, sweep, direction, best) -> None:
    """sweep/trials.csv, sweep/trials.md and sweep/sweep.png on the parent run; counts as metrics."""
    import csv

    importances = _importances(study)
    names = list(sweep.space)
    header = ["trial", "state", sweep.objective, "epochs", "seconds", *names, "run_id", "error"]
    rows = [
        [t.number, t.state, _num(t.value), t.epochs, _num(t.seconds),
         *[_cell(t.params.get(n)) for n in names], t.run_id or "", t.error or ""]
        for t in outcomes
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        with open(Path(tmp) / "trials.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
        md = [f"# sweep {sweep.name}: {sweep.objective} ({direction})", ""]
        if best:
            md += [f"best: trial {best.number}, {sweep.objective} {best.value:.4g}, {_fmt(best.params)}", ""]
        md += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        md += ["| " + " | ".join(_short(c).replace("|", "/") for c in r) + " |" for r in rows]
        if importances:
            md += ["", "parameter importance: " + ", ".join(f"{k} {v:.2f}" for k, v in importances.items())]
        (Path(tmp) / "trials.md").write_text("\n".join(md) + "\n")
        _plot(Path(tmp) / "sweep.png", outcomes, sweep.objective, direction, importances)
        client.log_artifacts(parent, tmp, "sweep")
    metrics = {f"trials_{s}": sum(t.state == s for t in outcomes) for s in ("complete", "pruned", "failed")}
    if best:
        metrics[f"best_{sweep.objective}"] = best.value
    metrics.update({f"importance.{k}": v for k, v in importances.items()})
    for k, v in metrics.items():
        client.log_metric(parent, k, v)


def _importances(study) -> dict[str, float]:
    import optuna
    from optuna.trial import TrialState

    if len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) < 2:
        return {}
    try:
        return optuna.importance.get_param_importances(study)
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}  # e.g. every completed trial had the same parameters


def _plot(path: Path, outcomes, objective: str, direction: str, importances: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    styles = {"complete": ("o", "tab:blue"), "pruned": ("x", "tab:orange")}
    for state, (marker, color) in styles.items():
        pts = [(t.number, t.value) for t in outcomes if t.state == state and t.value is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color, label=state)
    complete = sorted((t.number, t.value) for t in outcomes if t.state == "complete")
    if complete:
        pick = max if direction == "maximize" else min
        best = [pick(v for _, v in complete[: i + 1]) for i in range(len(complete))]
        ax.step([n for n, _ in complete], best, where="post", color="tab:green", label="best so far")
    failed = [t.number for t in outcomes if t.state == "failed"]
    for n in failed:
        ax.axvline(n, color="tab:red", alpha=0.3, lw=3, label="failed" if n == failed[0] else None)
    ax.set(xlabel="trial", ylabel=objective, title=f"{objective} per trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    ax.grid(alpha=0.3)
    if importances:
        keys = list(importances)[::-1]
        bx.barh(keys, [importances[k] for k in keys], color="tab:purple")
        bx.set(xlabel="importance", title="parameter importance")
    else:
        bx.text(0.5, 0.5, "needs 2 or more complete trials\nwith different parameters",
                ha="center", va="center", transform=bx.transAxes)
        bx.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _num(v) -> str:
    return "" if v is None else f"{v:.6g}"


def _short(cell) -> str:
    try:
        return f"{float(cell):.4g}" if "." in cell else cell
    except (TypeError, ValueError):
        return str(cell)


def _cell(v) -> str:
    return "" if v is None else json.dumps(v) if isinstance(v, list) else str(v)


def _fmt(params: dict) -> str:
    return ", ".join(f"{k}={_cell(v) if not isinstance(v, float) else f'{v:.4g}'}" for k, v in params.items())


def _say(msg: str) -> None:
    print(f"[shardline] {msg}", file=sys.stderr, flush=True)
