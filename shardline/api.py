"""shardline's Python API: prepare, train, score (and run, all three). The CLI calls these.

Each takes a config (a TOML path, a `ShardlineConfig`, a dict of sections, or None for the
defaults) plus `overrides` ("section.field=value" strings as `--set` takes them, or a
mapping {"section.field": value}), does every check it can before an engine starts, and
returns a small result object. `spark=` (a SparkSession, classic or Connect) and `client=`
(a Dask Client) are used instead of starting engines, and are never stopped here.

Which engine a stage runs on: the setting (pipelines.engine, training.launcher,
serving.engine) when the config writes it; else the kind of engine given (only a Dask
client: dask; only a SparkSession: spark); else the setting's default.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardline.jobs.config import (
    CHECKPOINTS,
    DATASET,
    OUTPUT,
    SOURCE,
    ShardlineConfig,
    check_storage,
    cluster_of,
    resolve_paths,
)
from shardline.jobs.config import load_config as _load
from shardline.jobs.engines import Engines, console, spark_ranks
from shardline.jobs.stages import check_prepare, dataset_lease, output_lease, run_prepare, run_score, run_train
from shardline.pipelines.errors import ConfigError
from shardline.pipelines.manifest import ShardManifest

Config = str | Path | ShardlineConfig | Mapping | None
Overrides = Iterable[str] | Mapping[str, Any]


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
class TrainResult:
    run_id: str
    model_uri: str  # models:/NAME/VERSION, or runs:/ID/model when not registered
    model_name: str
    model_version: str
    tracking_uri: str
    metrics: dict[str, float]
    checkpoint_dir: str
    launcher: str
    stopped_early: bool = False

    def to_dict(self) -> dict:
        from shardline.pipelines.redact import redact

        return {**dataclasses.asdict(self), "tracking_uri": redact(self.tracking_uri)}  # printed by --json


@dataclass
class ScoreResult:
    output_dir: str
    version_dir: str  # this model version's scores: OUTPUT/model=NAME/version=V
    rows: int  # rows scored by this call
    files_scored: int
    files_skipped: int  # already scored by this model version
    files_left: int  # scored by other versions only (backfill = "new")
    model_uri: str
    model_name: str
    model_version: str
    engine: str | None  # None: nothing to score, no engine started
    note: str = ""  # why nothing was scored
    discarded: list[str] = field(default_factory=list)  # what force=True removed

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class RunResult:
    prepare: PrepareResult
    train: TrainResult
    score: ScoreResult

    def to_dict(self) -> dict:
        return {"prepare": self.prepare.to_dict(), "train": self.train.to_dict(), "score": self.score.to_dict()}


def _keeps_callers_mlflow(fn):
    """MLflow keeps its tracking URI in a module global and copies it into
    os.environ["MLFLOW_TRACKING_URI"] (for subprocesses). A call whose config names its own
    store would leave the caller's later MLflow calls, and shardline's own default for
    tracking.tracking_uri, pointing at that store: put both back as they were."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        env = os.environ.get("MLFLOW_TRACKING_URI")
        utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
        before = getattr(utils, "_tracking_uri", None)
        try:
            return fn(*args, **kwargs)
        finally:
            utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
            if utils is not None:
                utils._tracking_uri = before
            if env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = env

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


@_keeps_callers_mlflow
def prepare(
    config: Config = None, overrides: Overrides = (), *, spark=None, client=None,
    append: bool = False, refit: bool = False, by_plan: bool = False,
) -> PrepareResult:
    """Validate, split, transform and shard `pipelines.source` into `pipelines.dataset_dir`.

    append: add the source as new shards (statistics frozen); with refit: re-prepare every
    source with new statistics. by_plan: lay shards out by the dataset's bandwidth plan.
    """
    if refit and not append:
        raise ConfigError("refit goes with append (re-prepare every source of the dataset)")
    if by_plan and append and not refit:
        raise ConfigError("by_plan lays every shard out anew: use it without append, or with append and refit")
    cfg = _choose(load_config(config, overrides), "pipelines.engine", spark, client)
    engine = cfg.pipelines.engine
    cfg = resolve_paths(cfg, [engine], (SOURCE, DATASET), spark=spark, client=client)
    check_storage(cfg, reads=(SOURCE,), writes=(DATASET,))
    checked = check_prepare(cfg, append=append, refit=refit, by_plan=by_plan)
    with dataset_lease(cfg) as lease, Engines(cfg, spark, client) as engines:
        manifest = run_prepare(cfg, engines.prepare_engine(engine), append=append, refit=refit,
                               by_plan=by_plan, lease=lease, checked=checked)
    return PrepareResult(cfg.pipelines.dataset_dir, manifest, engine)


@_keeps_callers_mlflow
def train(config: Config = None, overrides: Overrides = (), *, spark=None, client=None) -> TrainResult:
    """Train on the prepared dataset on `training.launcher`'s engine; track in MLflow; register."""
    from shardline.training.checkpoints import check_allowed
    from shardline.training.job import check_checkpoints, hold_checkpoint_dir, preflight

    cfg = _choose(load_config(config, overrides), "training.launcher", spark, client)
    launcher = cfg.training.launcher
    cfg = resolve_paths(cfg, [launcher], (DATASET, CHECKPOINTS), tracking=True, spark=spark, client=client)
    check_storage(cfg, reads=(DATASET,), writes=(CHECKPOINTS,))
    check_allowed(cfg.training.resume_allow_changed, "--allow-changed / training.resume_allow_changed")
    # One job per checkpoint directory: a second is refused here, before an engine starts,
    # and first: "in use by" says more than what the holder's checkpoints differ in.
    lease = hold_checkpoint_dir(cfg.training)
    try:
        # Names, the dataset, world size vs shards, batch vs rows, checkpoint_dir: one line
        # before an engine starts (the cluster's free slots are checked once it runs).
        check_checkpoints(cfg.training, preflight(cfg.training, cfg.pipelines.dataset_dir))
        with Engines(cfg, spark, client, spark_ranks(cfg)) as engines:
            result = run_train(cfg, engines, lease)
    finally:
        lease.release()
    return _train_result(cfg, result)


def _train_result(cfg: ShardlineConfig, r) -> TrainResult:
    return TrainResult(r.run_id, r.model_uri, r.model_name, r.model_version, r.tracking_uri, dict(r.metrics),
                       cfg.training.checkpoint_dir, cfg.training.launcher, r.stopped_early)


@_keeps_callers_mlflow
def score(
    config: Config = None, overrides: Overrides = (), *, spark=None, client=None,
    model_uri: str | None = None, input_path: str | None = None, force: bool = False,
) -> ScoreResult:
    """Batch-score `input_path` (default pipelines.dataset_dir: its serving.split; or raw
    Parquet) with `model_uri` (default serving.model_uri) into serving.output_dir, exactly
    once per input file and model version. force: discard the output's scores first."""
    from shardline.pipelines.storage import resolve
    from shardline.serving.score import plan

    cfg = load_config(config, overrides)
    if model_uri:
        cfg = load_config(cfg, {"serving.model_uri": model_uri})
    cfg = _choose(cfg, "serving.engine", spark, client)
    s = cfg.serving
    cfg = resolve_paths(cfg, [s.engine], (DATASET, OUTPUT), tracking=True, spark=spark, client=client)
    s = cfg.serving
    if not s.model_uri:
        raise ConfigError("no model: pass model_uri or set serving.model_uri")
    cluster = cluster_of(cfg, [s.engine], spark, client)
    input_path = resolve(input_path, "--input", cluster) if input_path else cfg.pipelines.dataset_dir
    check_storage(cfg, writes=(OUTPUT,), other_reads=(("--input", input_path),))
    # The output's lease first (a second job is refused at once, exit 75), then every check
    # and the plan, read-only; an engine starts only when there is something to score.
    with output_lease(s.output_dir) as lease:
        p = plan(s.model_uri, cfg.tracking.resolved_uri(), input_path, s.output_dir, split=s.split,
                 incremental=s.incremental, backfill=s.backfill, force=force,
                 allow_pickled=s.allow_pickled_models)
        discarded = p.describe_discard()
        for line in discarded:
            console.print(f"  [yellow]{_escape(line)}[/]")
        if not p.todo:
            return ScoreResult(p.out, p.dir, 0, 0, len(p.skipped), len(p.left), s.model_uri, p.model.name,
                               p.model.version, None, p.nothing_to_do(), discarded)
        with Engines(cfg, spark, client) as engines:
            r = run_score(cfg, engines, p, input_path, lease)
    return _score_result(r, s.model_uri, s.engine, discarded)


def _score_result(r, model_uri: str, engine: str, discarded: list[str]) -> ScoreResult:
    return ScoreResult(r.output_dir, r.version_dir, r.rows, r.files_scored, r.files_skipped, r.files_left,
                       model_uri, r.model_name, r.model_version, engine, "", discarded)


@_keeps_callers_mlflow
def score_status(config: Config = None, overrides: Overrides = (), *, output_dir: str,
                 input_path: str | None = None):
    """Per model version in `output_dir`: units and rows scored, what is pending (of
    `input_path` if given), the job writing there now. Starts no engine.
    Returns serving.status.OutputStatus (dataclasses)."""
    from shardline.pipelines.storage import resolve
    from shardline.serving.inputs import list_units
    from shardline.serving.status import output_status

    cfg = load_config(config, overrides)
    out = resolve(output_dir, "--status")
    reads = [("--status", out)]
    if input_path:
        input_path = resolve(input_path, "--input")
        reads.append(("--input", input_path))
    check_storage(cfg, other_reads=tuple(reads))
    return output_status(out, list_units(input_path, cfg.serving.split) if input_path else None)


@_keeps_callers_mlflow
def run(config: Config = None, overrides: Overrides = (), *, spark=None, client=None) -> RunResult:
    """Prepare (pipelines.engine), train (training.launcher), register, and score the new
    model (serving.engine), each on the engine its setting names; one engine of a kind is
    shared by the stages."""
    from shardline.serving.score import plan
    from shardline.training.job import check_settings
    from shardline.training.source_steps import check_steps_from_source
    from shardline.training.tracking import check_reachable

    cfg = load_config(config, overrides)
    for setting in ("pipelines.engine", "training.launcher", "serving.engine"):
        cfg = _choose(cfg, setting, spark, client)
    uses = [cfg.pipelines.engine, cfg.training.launcher, cfg.serving.engine]
    cfg = resolve_paths(cfg, uses, (SOURCE, DATASET, CHECKPOINTS, OUTPUT), tracking=True, spark=spark, client=client)
    check_settings(cfg.training)  # a misspelt model or strategy: one line, before an engine starts
    check_storage(cfg, reads=(SOURCE,), writes=(DATASET, CHECKPOINTS, OUTPUT))
    check_reachable(cfg.tracking.resolved_uri())  # a dead MLflow server: now, not after the prepare
    checked = check_prepare(cfg)
    # A batch the source's rows cannot give a step: now, not after prepare (training.source_steps).
    check_steps_from_source(cfg.training, cfg.pipelines, checked.files)
    with ExitStack() as stack:
        # Both leases before an engine starts: a second run on the same dirs is refused at once.
        dataset = stack.enter_context(dataset_lease(cfg))
        output = stack.enter_context(output_lease(cfg.serving.output_dir))
        engines = stack.enter_context(Engines(cfg, spark, client, spark_ranks(cfg)))
        manifest = run_prepare(cfg, engines.prepare_engine(cfg.pipelines.engine), lease=dataset, checked=checked)
        dataset.release()
        trained = run_train(cfg, engines)
        s = cfg.serving
        # force: each run trains a new model version and re-scores its own output with it.
        p = plan(trained.model_uri, trained.tracking_uri, cfg.pipelines.dataset_dir, s.output_dir, split=s.split,
                 incremental=s.incremental, backfill=s.backfill, force=True)
        for line in p.describe_discard():
            console.print(f"  [yellow]{_escape(line)}[/]")
        scored = run_score(cfg, engines, p, cfg.pipelines.dataset_dir, output)
    return RunResult(
        PrepareResult(cfg.pipelines.dataset_dir, manifest, cfg.pipelines.engine),
        _train_result(cfg, trained),
        _score_result(scored, trained.model_uri, s.engine, p.describe_discard()),
    )


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
