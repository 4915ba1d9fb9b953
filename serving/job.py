"""A scoring job on the driver: resolved once, checked before any effect, then run.

`ScoringJob.resolve` reads the serving section once — the model (serving.model_uri, or the
one a caller names: `shardline run` scores the version it just registered), the input (a
prepared dataset's serving.split, or raw Parquet), the output folder and its format, and
how the job scores (incremental, backfill, force, batch size, threads per task, pickled
models allowed) — into one object the API, `shardline run` and the estimators use alike.

`check` refuses, reading only, whatever cannot be scored: the model version (it exists; a
pytorch-flavour model only when serving.allow_pickled_models allows it), the input
(readable, not empty, the model's columns), the output folder (shardline's or new, no
other model's scores unless forced); and decides what to score (serving.score.plan).

`run` then takes the output's lease — last, after every check: a refused job never takes
over, or touches, a lease another job left — and runs the plan on the engine, opened only
when there is something to score.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

from shardline.foundation import report
from shardline.foundation.errors import ConfigError
from shardline.foundation.lease import Lease
from shardline.foundation.report import stage

from .config import ServingConfig
from .delta_output import scores_dir
from .ledger import all_scores, output_lease
from .models import ResolvedModel, resolve_model
from .score import ScorePlan, ScoreResult, check_owner, execute, plan


@dataclass
class ScoringJob:
    """One scoring job (see the module docstring)."""

    cfg: ServingConfig  # paths resolved (shardline.config.resolve_paths)
    tracking_uri: str
    input_path: str  # resolved
    model_uri: str | None  # None: named later (for_model: `shardline run`'s new version)
    force: bool = False
    plan: ScorePlan | None = field(default=None, repr=False)  # check()'s

    @classmethod
    def resolve(cls, cfg: ServingConfig, tracking_uri: str, input_path: str, *, model_uri: str | None = None,
                force: bool = False) -> ScoringJob:
        """The job of `cfg`; model_uri: this model instead of serving.model_uri. force: discard
        the output's scores (every model and version) first."""
        return cls(cfg, tracking_uri, input_path, model_uri or cfg.model_uri, force)

    @property
    def output(self) -> str:
        """The folder the job's scores and ledgers go to, and its lease is on."""
        return scores_dir(self.cfg.output_dir, self.cfg.output_format)

    def for_model(self, model_uri: str, tracking_uri: str) -> ScoringJob:
        """The same job with another model (`shardline run`'s newly registered version)."""
        return ScoringJob(self.cfg, tracking_uri, self.input_path, model_uri, self.force)

    # -- checks: read only ---------------------------------------------------------------

    def check_output(self, model_name: str) -> None:
        """What can be told of the output before the model exists (`shardline run` trains it
        first): another model's scores there, unless forced."""
        if not self.force:
            check_owner(self.output, all_scores(self.output), model_name)

    def check_model(self) -> ResolvedModel:
        """The model alone, checked as `check` checks it (the version exists, MLflow answers, a
        pytorch-flavour model only when allowed), pinned to its version: the check of scoring
        that has no input folder or output folder (the estimators' predictions on DataFrames)."""
        if not self.model_uri:
            raise ConfigError("no model: pass model_uri or set serving.model_uri")
        return resolve_model(self.model_uri, self.tracking_uri, self.cfg.allow_pickled_models)

    def check(self) -> ScoringJob:
        """The model version, the input and the output, and what to score; nothing written."""
        if not self.model_uri:
            raise ConfigError("no model: pass model_uri or set serving.model_uri")
        s = self.cfg
        self.plan = plan(self.model_uri, self.tracking_uri, self.input_path, s.output_dir, split=s.split,
                         incremental=s.incremental, backfill=s.backfill, force=self.force,
                         output_format=s.output_format, allow_pickled=s.allow_pickled_models)
        return self

    # -- effects ---------------------------------------------------------------------------

    def run(self, engine: Callable[[], object], lease: Lease | None = None) -> ScoreResult:
        """Take the output's lease (a second job is refused, exit 75), then score what `check`
        found on `engine()` (serving.engine's, shardline.engines.base.Engine: called only when
        there is something to score). lease: the output's, held already (`shardline run` holds
        every folder of the run before its engines start)."""
        p = self.plan
        if p is None:
            raise AssertionError("ScoringJob.run before check")
        with nullcontext(lease) if lease is not None else output_lease(self.output) as held:
            for line in p.describe_discard():
                report.warn(line)
            if not p.todo:
                p.publish()  # a Delta output: what an earlier run committed but did not append
                return p.nothing_done()
            on = engine()
            with stage(f"Scoring {len(p.todo)} file(s) of {self.input_path} with {p.describe_model()} on "
                       f"{on.name}"):
                return execute(p, on, batch_size=self.cfg.batch_size, threads_per_task=self.cfg.threads_per_task,
                               lease=held)
