"""The stages of the API's calls (shardline.api), each between its reporter's lines: the
checks before an engine starts, the leases, and the prepare, training and scoring runs."""

from __future__ import annotations

from shardline.foundation import report
from shardline.foundation.report import stage
from shardline.pipelines.manifest import check_dataset_dir
from shardline.serving.ledger import check_output_dir, output_lease as lease

from .config import ShardlineConfig
from .engines import engine_class

# Imported inside the functions that use them: pipelines.prepare (imports pandas); pipelines.checks (imports
# pandas).


def dataset_lease(cfg: ShardlineConfig):
    from shardline.pipelines.prepare import dataset_lease as lease

    check_dataset_dir(cfg.pipelines.dataset_dir)  # a foreign directory: refused before we write
    return lease(cfg.pipelines.dataset_dir)


def output_lease(output_dir: str):
    check_output_dir(output_dir)
    return lease(output_dir)


def check_prepare(cfg: ShardlineConfig, **how):
    """Input, columns and feature spec, checked before an engine starts; says what it inferred."""
    from shardline.pipelines.checks import check_prepare as check

    reads_tables = engine_class(cfg.pipelines.engine, "pipelines.engine").reads_tables
    checked = check(cfg.pipelines, reads_tables=reads_tables, **how)
    for note in checked.notes:
        report.note(note)
    return checked


def run_prepare(cfg: ShardlineConfig, engine, append=False, refit=False, by_plan=False, lease=None, checked=None,
                frame=None):
    from shardline.pipelines.prepare import prepare

    what = "the DataFrame given" if frame is not None else cfg.pipelines.source.describe()
    how = " by its bandwidth plan" if by_plan else ""
    with stage(f"Preparing {what} into {cfg.pipelines.dataset_dir}{how} with {engine.name}"):
        manifest = prepare(engine, cfg.pipelines, append=append, refit=refit, by_plan=by_plan, lease=lease,
                           checked=checked, frame=frame)
    spec = manifest.feature_spec
    if spec.task == "classification" and spec.classes is None:
        report.note(
            f"pipelines.features.classes = {manifest.statistics.num_classes}  "
            "(inferred: the largest label + 1; declare it to have other labels refused)"
        )
    return manifest


def run_train(job, engine):
    """A checked training.job.TrainingJob, run on `engine` (training.launcher's)."""
    t = job.cfg
    job.check_capacity(engine)
    report.note(f"checkpoints: {t.checkpoint_dir}")
    what = f"with the loop {t.loop}" if t.loop else t.model
    with stage(f"Training {what} with {t.strategy} on {t.world_size} {engine.name} ranks"):
        return job.run(engine)


def run_distributed(job, engine):
    """A checked training.distributed.DistributedJob, on `engine` (its launcher's)."""
    t = job.cfg
    job.check_capacity(engine)
    with stage(f"Running {job.call.fn.path} on {t.world_size} {engine.name} ranks"):
        return job.run(engine)
