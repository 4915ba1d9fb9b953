"""shardline's Python API: prepare, train, score, run (all three), sweep, plan, score_status.

The CLI (jobs/cli.py), a notebook, a spark-submit script and the estimators all call these.
Each takes a config (a TOML path, a `ShardlineConfig`, a dict of sections, or None for the
defaults) plus `overrides` ("section.field=value" strings as `--set` takes them, or a
mapping {"section.field": value}) and works in one order: the config resolved once (paths
as every host opens them, engines, the user's code, the strategy), then every check, then
the effects. A refusal — a ConfigError, DataError, StorageError... one line naming the
setting, file or column — leaves every byte and every MLflow run as it was. `spark=` (a
SparkSession, classic or Connect) and `client=` (a Dask Client) are used instead of
starting engines, and are never stopped here. Progress goes to the process's reporter
(foundation.report).

Which engine a stage runs on: the setting (pipelines.engine, training.launcher,
serving.engine) when the config writes it; else the kind of engine given (only a Dask
client: dask; only a SparkSession: spark); else the setting's default.
"""

# What a user's code calls: type-checked in pyright's basic mode ([tool.pyright] in pyproject.toml).
# pyright: basic
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from shardline.config import (
    CHECKPOINTS,
    DATASET,
    OUTPUT,
    SOURCE,
    ShardlineConfig,
    check_folders,
    check_storage,
    checkpoint_store,
    cluster_of,
    resolve_paths,
)
from shardline.config import load_config as _load
from shardline.engines import Engines, engine_class, frame_engine, given_engines, given_pair
from shardline.foundation.errors import ConfigError
from shardline.foundation.overlap import glob_base
from shardline.pipelines.manifest import ShardManifest
from shardline.foundation.report import stage
from shardline.foundation.storage import resolve
from shardline.serving.inputs import list_units
from shardline.serving.job import ScoringJob
from shardline.serving.score import ScoreResult
from shardline.serving.status import output_status
from shardline.sizing import ForecastResult, PlanResult, forecast, plan  # sizing a job before it runs
from shardline.stages import check_prepare, dataset_lease, output_lease, run_prepare, run_train
from shardline.training.result import TrainResult
from shardline.training.tracking import check_store

# Imported inside the functions that use them: training.job (imports torch); training.source_steps (imports
# torch); training.sweeps.run (imports torch).

if TYPE_CHECKING:  # for a type checker; at run time __getattr__ below imports it when asked
    from shardline.training.loop.context import LoopContext


def __getattr__(name: str):
    if name == "LoopContext":  # for typing a loop: torch only when asked for
        from shardline.training.loop.context import LoopContext

        return LoopContext
    raise AttributeError(f"module 'shardline.api' has no attribute {name!r}")

Config = str | Path | ShardlineConfig | Mapping | None
Overrides = Iterable[str] | Mapping[str, Any]

__all__ = ["prepare", "train", "score", "run", "sweep", "plan", "forecast", "score_status", "load_config",
           "PrepareResult", "TrainResult", "ScoreResult", "RunResult", "PlanResult", "ForecastResult", "LoopContext"]


@dataclass
class PrepareResult:
    dataset_dir: str  # resolved: an absolute path or a URL
    manifest: ShardManifest  # the version this call committed
    engine: str

    def to_dict(self) -> dict:
        m = self.manifest
        return {
            "dataset_dir": self.dataset_dir, "engine": self.engine, "version_id": m.version_id,
            "sequence": m.sequence, "dropped_rows": m.dropped_rows, "imputed_values": m.imputed_values,
            "num_classes": m.statistics.num_classes,
            "splits": {s: {"rows": i.rows, "shards": len(i.shards)} for s, i in m.splits.items()},
        }


@dataclass
class RunResult:
    prepare: PrepareResult
    train: TrainResult
    score: ScoreResult

    def to_dict(self) -> dict:
        return {"prepare": self.prepare.to_dict(), "train": self.train.to_dict(), "score": self.score.to_dict()}


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _keeps_callers_mlflow(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """The call leaves the caller's MLflow tracking URI as it was (training.tracking.
    callers_store_kept): a config naming its own store does not repoint the caller's."""

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        from shardline.training.tracking import callers_store_kept

        with callers_store_kept():
            return fn(*args, **kwargs)

    return call


def load_config(config: Config = None, overrides: Overrides = ()) -> ShardlineConfig:
    """The typed config: `config` with `overrides` applied, validated (one ConfigError if not)."""
    return _load(config, overrides)


def _choose(cfg: ShardlineConfig, setting: str, spark, client) -> ShardlineConfig:
    """The stage's engine, by the rule in the module docstring, written into the config."""
    section_name, _, name = setting.partition(".")
    section = getattr(cfg, section_name)
    value = getattr(section, name)
    if name not in section.model_fields_set:
        value = "dask" if client is not None and spark is None else "spark" if spark is not None and client is None \
            else value
    return cfg.model_copy(update={section_name: section.model_copy(update={name: value})})


def _training_job(given: ShardlineConfig, cfg: ShardlineConfig, loop=None):
    """The training section resolved into one job object (training.job.TrainingJob); `given`
    is the config as written (an unset checkpoint_dir makes the folder the job's own);
    `loop`: the function given to train(loop=...), as its LoopFunction."""
    from shardline.training.job import TrainingJob  # torch and MLflow: only when training

    return TrainingJob.resolve(cfg.training, cfg.tracking, cfg.pipelines.dataset_dir,
                               store=checkpoint_store(given, cfg), loop=loop)


def _with_loop(cfg: ShardlineConfig, loop):
    """A loop function given to the API: (the config naming it as training.loop, its
    LoopFunction: by import path, or by value when no rank could import it)."""
    if loop is None:
        return cfg, None
    from shardline.training.loop.function import LoopFunction  # torch: only when training

    fn = LoopFunction.of(loop)
    return cfg.model_copy(update={"training": cfg.training.model_copy(update={"loop": fn.path})}), fn


@_keeps_callers_mlflow
def prepare(
    config: Config = None, overrides: Overrides = (), *, spark=None, client=None,
    append: bool = False, refit: bool = False, by_plan: bool = False, source=None,
) -> PrepareResult:
    """Validate, split, transform and shard `pipelines.source` into `pipelines.dataset_dir`.

    append: add the source as new shards (statistics frozen); with refit: re-prepare every
    source with new statistics. by_plan: lay shards out by the dataset's bandwidth plan.
    source: a Spark or Dask DataFrame to prepare instead of pipelines.source, on its own
    session (or the client given, else Dask's default client).
    """
    if refit and not append:
        raise ConfigError("refit goes with append (re-prepare every source of the dataset)")
    if by_plan and append and not refit:
        raise ConfigError("by_plan lays every shard out anew: use it without append, or with append and refit")
    cfg = load_config(config, overrides)
    if source is not None:
        cfg, spark, client = _frame_engine(cfg, source, spark, client)
    cfg = _choose(cfg, "pipelines.engine", spark, client)
    engine = cfg.pipelines.engine
    cfg = resolve_paths(cfg, [engine], (SOURCE, DATASET) if source is None else (DATASET,), spark=spark,
                        client=client)
    check_storage(cfg, reads=(SOURCE,) if source is None else (), writes=(DATASET,))
    checked = check_prepare(cfg, append=append, refit=refit, by_plan=by_plan, frame=source is not None)
    with dataset_lease(cfg) as lease, Engines(cfg, spark, client) as engines:
        manifest = run_prepare(cfg, engines.get(engine, "pipelines.engine"), append=append, refit=refit,
                               by_plan=by_plan, lease=lease, checked=checked, frame=source)
    return PrepareResult(cfg.pipelines.dataset_dir, manifest, engine)


def _frame_engine(cfg: ShardlineConfig, df, spark, client):
    """A DataFrame's own engine: a Spark one's session, a Dask one's client (the one given,
    else the default); pipelines.engine must be that engine's."""
    engine = frame_engine(df)
    p = cfg.pipelines
    if "engine" in p.model_fields_set and engine is not engine_class(p.engine, "pipelines.engine"):
        raise ConfigError(f"source: a {engine.name} DataFrame, but pipelines.engine = '{p.engine}'")
    given = given_engines(spark, client)
    given[engine.name] = given[engine.name] or engine.frame_session(df)
    cfg = cfg.model_copy(update={"pipelines": p.model_copy(update={"engine": engine.name})})
    return cfg, *given_pair(given)


@_keeps_callers_mlflow
def train(config: Config = None, overrides: Overrides = (), *, spark=None, client=None, loop=None) -> TrainResult:
    """Train on the prepared dataset on `training.launcher`'s engine; track in MLflow; register.

    loop: your own training loop, a function of one argument (the loop context,
    `shardline.LoopContext`) run on every rank, in place of `training.loop`: one defined in
    an importable module travels by its import path (its package with the job's code), one
    defined in a notebook or a script's `__main__` by value (cloudpickle). Unset, and
    training.loop unset: shardline's own loop trains training.model."""
    given, fn = _with_loop(load_config(config, overrides), loop)
    given = _choose(given, "training.launcher", spark, client)
    cfg = resolve_paths(given, [given.training.launcher], (DATASET, CHECKPOINTS), tracking=True, spark=spark,
                        client=client)
    job = _training_job(given, cfg, fn)
    check_storage(cfg, reads=(DATASET,), writes=(CHECKPOINTS,))
    # One job per checkpoint folder, refused first: "in use by" says more than what the
    # holder's checkpoints differ in. Folders made only for the lease go with it.
    job.hold()
    try:
        job.check()  # everything else, before an engine starts
        with Engines(cfg, spark, client, _ranks(cfg)) as engines:
            return run_train(job, engines.get(cfg.training.launcher, "training.launcher"))
    finally:
        job.store.release()


def _ranks(cfg: ShardlineConfig) -> tuple[str, int]:
    """The call's training ranks and their engine, for Engines to check as it opens it."""
    return cfg.training.launcher, cfg.training.world_size


def _scoring_job(cfg: ShardlineConfig, input_path: str, force: bool):
    """The serving section resolved into one job object (serving.job.ScoringJob)."""
    return ScoringJob.resolve(cfg.serving, cfg.tracking.resolved_uri(), input_path, force=force)


@_keeps_callers_mlflow
def score(
    config: Config = None, overrides: Overrides = (), *, spark=None, client=None,
    model_uri: str | None = None, input_path: str | None = None, force: bool = False,
) -> ScoreResult:
    """Batch-score `input_path` (default pipelines.dataset_dir: its serving.split; or raw
    Parquet) with `model_uri` (default serving.model_uri) into serving.output_dir, exactly
    once per input file and model version. force: discard the output's scores first."""
    cfg = load_config(config, overrides)
    if model_uri:
        cfg = load_config(cfg, {"serving.model_uri": model_uri})
    cfg = _choose(cfg, "serving.engine", spark, client)
    cfg = resolve_paths(cfg, [cfg.serving.engine], (DATASET, OUTPUT), tracking=True, spark=spark, client=client,
                        apart=())
    s = cfg.serving
    if not s.model_uri:
        raise ConfigError("no model: pass model_uri or set serving.model_uri")
    cluster = cluster_of(cfg, [s.engine], spark, client)
    scored = "--input" if input_path else DATASET
    input_path = resolve(input_path, "--input", cluster) if input_path else cfg.pipelines.dataset_dir
    check_folders(cfg, (OUTPUT,), ((scored, glob_base(input_path)),))  # the scores never among what they score
    check_storage(cfg, writes=(OUTPUT,), other_reads=(("--input", input_path),))
    check_store(cfg.tracking.resolved_uri())
    # Every check first, read-only: the model version, the input, the output folder. The
    # output's lease last (serving.job): a refused job never takes over a lease another left.
    job = _scoring_job(cfg, input_path, force).check()
    with Engines(cfg, spark, client) as engines:
        # An engine starts only when there is something to score.
        return job.run(lambda: engines.get(s.engine, "serving.engine"))


@_keeps_callers_mlflow
def score_status(config: Config = None, overrides: Overrides = (), *, output_dir: str,
                 input_path: str | None = None):
    """Per model version in `output_dir`: units and rows scored, what is pending (of
    `input_path` if given), the job writing there now. Starts no engine.
    Returns serving.status.OutputStatus (dataclasses)."""
    cfg = load_config(config, overrides)
    out = resolve(output_dir, "--status")
    reads = [("--status", out)]
    if input_path:
        input_path = resolve(input_path, "--input")
        reads.append(("--input", input_path))
    check_storage(cfg, other_reads=tuple(reads))
    return output_status(out, list_units(input_path, cfg.serving.split) if input_path else None)


@_keeps_callers_mlflow
def run(config: Config = None, overrides: Overrides = (), *, spark=None, client=None, force: bool = False) -> RunResult:
    """Prepare (pipelines.engine), train (training.launcher), register, and score the new
    model (serving.engine), each on the engine its setting names; one engine of a kind is
    shared by the stages. The new version scores into its own version=V/ beside the
    earlier versions' scores; force: discard the output's scores first, as score's does."""
    from shardline.training.source_steps import check_steps_from_source

    given = load_config(config, overrides)
    for setting in ("pipelines.engine", "training.launcher", "serving.engine"):
        given = _choose(given, setting, spark, client)
    uses = [given.pipelines.engine, given.training.launcher, given.serving.engine]
    cfg = resolve_paths(given, uses, (SOURCE, DATASET, CHECKPOINTS, OUTPUT), tracking=True, spark=spark, client=client)
    job = _training_job(given, cfg)
    scoring = _scoring_job(cfg, cfg.pipelines.dataset_dir, force)  # its model: the one trained
    # What can be checked before the dataset exists, before anything is written: the
    # settings, the stores, the checkpoint folder, the MLflow store, the input.
    job.check_settings()
    check_storage(cfg, reads=(SOURCE,), writes=(DATASET, CHECKPOINTS, OUTPUT))
    job.check_folder()
    check_store(job.tracking_uri)
    # Another model's scores in the output: refused now, not after the training.
    scoring.check_output(cfg.tracking.registered_model or "an unregistered model")
    checked = check_prepare(cfg)
    # A batch the source's rows cannot give a step: now, not after prepare (training.source_steps).
    check_steps_from_source(cfg.training, cfg.pipelines, checked.files)
    with ExitStack() as stack:
        # Every lease before an engine starts: a second run on the same folders is refused at once.
        dataset = stack.enter_context(dataset_lease(cfg))
        output = stack.enter_context(output_lease(scoring.output))
        job.hold()
        stack.callback(job.store.release)
        engines = stack.enter_context(Engines(cfg, spark, client, _ranks(cfg)))
        manifest = run_prepare(cfg, engines.get(cfg.pipelines.engine, "pipelines.engine"), lease=dataset,
                               checked=checked)
        dataset.release()
        job.check()  # the model on the dataset just made
        trained = run_train(job, engines.get(cfg.training.launcher, "training.launcher"))
        if trained.model_uri is None:  # a user's loop that registered no model: nothing to score
            s = cfg.serving
            return RunResult(PrepareResult(cfg.pipelines.dataset_dir, manifest, cfg.pipelines.engine), trained,
                             ScoreResult(s.output_dir, "", 0, 0, 0, 0, "", "", "", None,
                                         "nothing scored: the loop registered no model (ctx.register)"))
        scoring = scoring.for_model(trained.model_uri, trained.tracking_uri).check()
        scored = scoring.run(lambda: engines.get(cfg.serving.engine, "serving.engine"), output)
    return RunResult(PrepareResult(cfg.pipelines.dataset_dir, manifest, cfg.pipelines.engine), trained, scored)


@_keeps_callers_mlflow
def sweep(config: Config = None, overrides: Overrides = ()):
    """Search hyperparameters with Optuna (sweep.*): trials are MLflow child runs of one
    parent run, run in parallel on sweep.engine; the best model is registered. A sweep
    whose name exists resumes it. Returns training.sweeps.run.SweepResult."""
    from shardline.training.sweeps.run import check_parallel, check_sweep, run_sweep, trial_base

    cfg = load_config(config, overrides)
    where = cfg.sweep.engine or cfg.training.launcher
    cfg = resolve_paths(cfg, [where], (DATASET, CHECKPOINTS), tracking=True, sweep=True)
    check_storage(cfg, reads=(DATASET,), writes=(CHECKPOINTS,))
    check_sweep(cfg.sweep, cfg.training, cfg.pipelines.dataset_dir)  # before any engine starts
    with Engines(cfg, ranks=(where, cfg.sweep.world_size)) as engines:
        engine = engines.get(where, "sweep.engine")
        # More trials at once than the engine runs: refused before the sweep starts.
        check_parallel(cfg.sweep, trial_base(cfg.sweep, cfg.training), engine)
        with stage(f"Sweep '{cfg.sweep.name}' on {where}"):
            return run_sweep(cfg.sweep, cfg.training, cfg.tracking, cfg.pipelines.dataset_dir, engine)
