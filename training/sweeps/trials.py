"""A sweep's trials, run from the driver: each an MLflow child run of the sweep's parent run
and a training job (training.job.run_training) on a driver thread, told to the study as it
ends (complete, pruned or failed); and the trials an interrupted sweep left running, closed
and queued to run again.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from shardline.foundation import report
from shardline.foundation.storage import join as join_url
from shardline.foundation.errors import ShardlineError, first_line

from ..config import TrackingConfig, TrainingConfig
from ..job import run_training
from .config import SweepConfig, with_setting
from .report import fmt_params
from .study import PruningReporter, decode

# Imported inside the functions that use them: Optuna (only in a sweep); MLflow (~2.5 s: only where MLflow is
# called).


@dataclass
class Trials:
    """What starting a trial takes, the same for every trial of the sweep: each is an MLflow child
    run of `parent` and a training job on a driver thread, whose outcome it puts in `results`."""

    sweep: SweepConfig
    base: TrainingConfig
    tracking: TrackingConfig
    dataset_dir: str
    engine: object
    client: object  # mlflow.tracking.MlflowClient
    experiment_id: str
    parent: str
    storage_url: str
    max_epochs: int
    results: queue.Queue = field(default_factory=queue.Queue)

    def start(self, trial, group: list[str] | None) -> str:
        """Start `trial` on the workers `group` (None: where the engine puts it); its MLflow run's id."""
        sweep = self.sweep
        run_id = self.client.create_run(
            self.experiment_id,
            run_name=f"sweep {sweep.name} trial {trial.number}",
            tags={
                "mlflow.parentRunId": self.parent,
                "shardline.sweep": sweep.name,
                "trial_number": str(trial.number),
                "trial_state": "running",
            },
        ).info.run_id
        trial.set_user_attr("mlflow_run_id", run_id)
        hook = PruningReporter(
            self.storage_url, sweep.name, trial._trial_id, sweep.objective, sweep, self.max_epochs
        )
        params = {n: decode(n, v) for n, v in trial.params.items()}
        say(f"trial {trial.number} started: {fmt_params(params)}")
        threading.Thread(
            target=_run_trial,
            args=(self.results, trial.number, self.base, sweep.name, params, self.tracking, self.dataset_dir,
                  self.engine, run_id, hook, group),
            name=f"trial-{trial.number}",
            daemon=True,  # Ctrl-C ends the sweep now; the study marks the trial interrupted
        ).start()
        return run_id


def run_trials(study, dists: dict, todo: int, groups: list[list[str]] | None, trials: Trials) -> int:
    """Run `todo` trials, sweep.parallel at a time, each told to the study as it ends; how many started."""
    running: dict[int, tuple] = {}
    free_groups = list(groups) if groups is not None else None
    started = 0
    while started < todo or running:
        while started < todo and len(running) < trials.sweep.parallel:
            trial = study.ask(dists)
            group = free_groups.pop() if free_groups is not None else None
            running[trial.number] = (trial, trials.start(trial, group), group)
            started += 1
        number, result, error = trials.results.get()
        trial, run_id, group = running.pop(number)
        if group is not None:
            free_groups.append(group)
        _tell(study, trial, run_id, result, error, trials.sweep.objective, trials.client)
    return started


def _run_trial(results, number, base, name, params, tracking, dataset_dir, engine, run_id, hook, group) -> None:
    """A driver thread: one training job; whatever happens goes back through `results`."""
    try:
        # Its own checkpoint directory: a job deletes stale checkpoints in its own at start.
        ckpt = join_url(base.checkpoint_dir, "sweeps", name, f"trial-{number}")
        settings = base.model_dump()
        for key, value in {**params, "checkpoint_dir": ckpt}.items():
            settings = with_setting(settings, key, value)
        cfg = TrainingConfig.model_validate(settings)
        result = run_training(
            cfg, tracking, dataset_dir, engine, into_run=run_id, register=False, epoch_hook=hook, workers=group,
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
        say(f"trial {trial.number} pruned after epoch {epochs}")
        return
    if error is None and objective not in result.metrics:
        error = ShardlineError(f"training logged no '{objective}'")
    if error is None:
        value = result.metrics[objective]
        study.tell(trial, value)
        client.set_tag(run_id, "trial_state", "complete")
        say(f"trial {trial.number} complete: {objective} {value:.4g}")
        return
    reason = _reason(error)
    trial.set_user_attr("error", reason)
    study.tell(trial, state=TrialState.FAIL)
    client.set_tag(run_id, "trial_state", "failed")
    client.set_tag(run_id, "trial_error", reason)
    client.set_terminated(run_id, "FAILED")  # also when it failed before training opened it
    say(f"trial {trial.number} failed: {reason}")


def _reason(e: BaseException) -> str:
    return first_line(e, 500, with_type=not isinstance(e, ShardlineError))


def counts(t) -> bool:
    """A finished trial counts toward sweep.trials; an interrupted one is run again."""
    return t.state.is_finished() and not t.user_attrs.get("interrupted")


def close_interrupted(study, storage, client, parent: str) -> None:
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
        say(f"trial {t.number} was interrupted: it runs again")


def say(msg: str) -> None:
    report.line(f"[shardline] {msg}")
