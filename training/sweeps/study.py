"""The Optuna side of a sweep: its storage, sampler, pruner and search space, and the
epoch hook that reports a trial's objective from its rank 0."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_origin

from shardline.foundation.errors import ConfigError, ShardlineError, first_line
from shardline.foundation.redact import redact

from ..config import setting_field
from .config import ParamSpace, SweepConfig

# Imported inside the functions that use them: Optuna (only in a sweep).


def resolve_storage(sweep: SweepConfig, tracking_uri: str) -> str:
    """sweep.storage, else <stem>-optuna.db beside a SQLite tracking store, else ./optuna.db."""
    if sweep.storage:
        return sweep.storage
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///") :])
        return f"sqlite:///{db.with_name(db.stem + '-optuna.db')}"
    return f"sqlite:///{Path.cwd() / 'optuna.db'}"


def open_storage(url: str):
    from optuna.storages import RDBStorage

    # Concurrent trials write to one SQLite file: wait for its lock rather than fail.
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    try:
        return RDBStorage(url, engine_kwargs=kwargs)
    except Exception as e:  # a bad URL, a missing driver, an unreachable server
        raise ShardlineError(redact(f"sweep.storage: {url} is not usable ({first_line(e, 200)})")) from None


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


def make_sampler(sweep: SweepConfig, seed: int):
    from optuna import samplers

    if sweep.sampler == "grid":

        class Grid(samplers.GridSampler):
            # GridSampler calls study.stop() when the grid is done, which only works
            # inside study.optimize; the sweep caps its trials at the grid size itself.
            def after_trial(self, study, trial, state, values) -> None:
                pass

        return Grid(grid(sweep.space), seed=seed)
    if sweep.sampler == "random":
        return samplers.RandomSampler(seed=seed)
    return samplers.TPESampler(seed=seed)


def encode(value):
    # Optuna stores scalars only: a list choice (training.hidden) travels as JSON text.
    return json.dumps(value) if isinstance(value, list) else value


def decode(name: str, value):
    is_list = get_origin(setting_field(name).annotation) is list
    return json.loads(value) if is_list and isinstance(value, str) else value


def distribution(space: ParamSpace):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if space.type == "categorical":
        return CategoricalDistribution([encode(c) for c in space.choices])
    if space.type == "int":
        step = int(space.step or 1)
        return IntDistribution(int(space.low), int(space.high), log=space.log, step=step)
    return FloatDistribution(space.low, space.high, log=space.log, step=space.step)


def grid(spaces: dict[str, ParamSpace]) -> dict[str, list]:
    grid = {}
    for name, s in spaces.items():
        if s.type == "categorical":
            grid[name] = [encode(c) for c in s.choices]
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
