"""The stages of the API's calls (shardline.api), each between its reporter's lines: the
checks before an engine starts, the leases, and the prepare, training and scoring runs."""

from __future__ import annotations

from shardline.foundation import report
from shardline.foundation.report import stage

from .config import ShardlineConfig
from .engines import Engines


def dataset_lease(cfg: ShardlineConfig):
    from shardline.pipelines.manifest import check_dataset_dir
    from shardline.pipelines.prepare import dataset_lease as lease

    check_dataset_dir(cfg.pipelines.dataset_dir)  # a foreign directory: refused before we write
    return lease(cfg.pipelines.dataset_dir)


def output_lease(output_dir: str):
    from shardline.serving.ledger import check_output_dir, output_lease as lease

    check_output_dir(output_dir)
    return lease(output_dir)


def check_prepare(cfg: ShardlineConfig, **how):
    """Input, columns and feature spec, checked before an engine starts; says what it inferred."""
    from shardline.pipelines.checks import check_prepare as check

    checked = check(cfg.pipelines, **how)
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


def run_train(job, engines: Engines):
    """A checked training.job.TrainingJob, run on training.launcher's engine (none for `local`)."""
    t = job.cfg
    handle = engines.handle(t.launcher)
    spark = handle if t.launcher == "spark" else None
    client = handle if t.launcher == "dask" else None
    job.check_capacity(spark, client)
    report.note(f"checkpoints: {t.checkpoint_dir}")
    what = f"with the loop {t.loop}" if t.loop else t.model
    with stage(f"Training {what} with {t.strategy} on {t.world_size} {t.launcher} ranks"):
        return job.run(spark, client)


def run_distributed(job, engines: Engines):
    """A checked training.distributed.DistributedJob, on its launcher's engine (none for `local`)."""
    from shardline.training.job import check_capacity

    t = job.cfg
    handle = engines.handle(t.launcher)
    spark = handle if t.launcher == "spark" else None
    client = handle if t.launcher == "dask" else None
    check_capacity(t, spark, client)
    with stage(f"Running {job.call.fn.path} on {t.world_size} {t.launcher} ranks"):
        return job.run(spark, client)


def run_score(cfg: ShardlineConfig, engines: Engines, p, input_path: str, lease=None):
    """serving.score.execute of plan `p` on serving.engine."""
    from shardline.serving.score import execute

    s = cfg.serving
    handle = engines.handle(s.engine)
    with stage(f"Scoring {len(p.todo)} file(s) of {input_path} with {p.describe_model()} on {s.engine}"):
        return execute(p, s.engine, handle, batch_size=s.batch_size, threads_per_task=s.threads_per_task,
                       lease=lease)
