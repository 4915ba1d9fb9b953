"""The `shardline` command: parse, call, report. No logic of its own."""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardline.pipelines.errors import ShardlineError

from .config import (
    CHECKPOINTS,
    DATASET,
    OUTPUT,
    SOURCE,
    ShardlineConfig,
    check_storage,
    cluster_of,
    load_config,
    resolve_paths,
)
from .cli_bench import bench
from .engines import console, engine_handle, open_dask, open_spark, prepare_engine, spark_ranks, stage
from .ui import ui_hint

_set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.FIELD=VALUE",
    help="Override any config field, e.g. --set training.epochs=3 (repeatable).",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardline")
def cli():
    """shardline: raw data to a trained, tracked PyTorch model and scored outputs,
    on Spark (and Dask)."""


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False))
@_set_option
def run(config, overrides):
    """Generate/prepare data, train with DDP on a Spark barrier stage, register, score."""
    cfg = load_config(config, list(overrides))
    cfg = resolve_paths(cfg, ["spark", cfg.training.launcher], (SOURCE, DATASET, CHECKPOINTS, OUTPUT), tracking=True)
    from shardline.training.job import check_settings

    check_settings(cfg.training)  # a misspelt model or strategy: one line, before Spark starts
    check_storage(cfg, reads=(SOURCE,), writes=(DATASET, CHECKPOINTS, OUTPUT))
    from shardline.training.tracking import check_reachable

    check_reachable(cfg.tracking.resolved_uri())  # a dead MLflow server: now, not after the prepare
    checked = _check_prepare(cfg)
    with ExitStack() as leases:
        # Both leases before Spark starts: a second run on the same dirs is refused at once.
        dataset = leases.enter_context(_dataset_lease(cfg))
        output = leases.enter_context(_output_lease(cfg.serving.output_dir))
        spark = open_spark(cfg, spark_ranks(cfg))
        from shardline.pipelines.engine_spark import SparkEngine

        manifest = _prepare(cfg, SparkEngine(spark), lease=dataset, checked=checked)
        dataset.release()
        result = _train(cfg, spark)
        # force: each run trains a new model version and re-scores its own output with it.
        score = _score(
            cfg, "spark", spark, result.model_uri, result.tracking_uri, cfg.pipelines.dataset_dir,
            force=True, lease=output,
        )

    table = Table(title="shardline run", show_header=False, title_justify="left")
    for split, info in manifest.splits.items():
        table.add_row(f"rows {split}", f"{info.rows:,} in {len(info.shards)} shards")
    for k in ("val_accuracy", "val_rmse", "val_r2"):
        if k in result.metrics:
            table.add_row(k.replace("_", " "), f"{result.metrics[k]:.4f}")
    table.add_row("MLflow run", result.run_id)
    table.add_row("MLflow store", result.tracking_uri)
    table.add_row("model", f"{result.model_uri}")
    table.add_row("dataset", cfg.pipelines.dataset_dir)
    table.add_row("scores", f"{score.output_dir} ({score.rows:,} rows)")
    table.add_row("open the UI", ui_hint(result.tracking_uri))
    Console().print(table)


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False))
@_set_option
@click.option("--engine", type=click.Choice(["spark", "dask"]), help="Overrides pipelines.engine.")
@click.option("--append", is_flag=True, help="Add the source as new shards; statistics stay frozen.")
@click.option(
    "--refit",
    is_flag=True,
    help="With --append: re-prepare all sources of the dataset plus this one with new statistics.",
)
@click.option(
    "--plan",
    "by_plan",
    is_flag=True,
    help="Lay the shards out by the bandwidth plan stored in the existing dataset's manifest "
    "(`shardline plan`): train gets shards_per_rank x world_size shards, every split the plan's "
    "rows per row group (val/test shard counts keep the size rule); the new manifest keeps the plan.",
)
def prepare(config, overrides, engine, append, refit, by_plan):
    """Validate, split, transform and shard raw data into a prepared dataset."""
    extra = [f"pipelines.engine='{engine}'"] if engine else []
    cfg = load_config(config, list(overrides) + extra)
    cfg = resolve_paths(cfg, [cfg.pipelines.engine], (SOURCE, DATASET))
    if refit and not append:
        raise click.UsageError("--refit goes with --append")
    if by_plan and append and not refit:
        raise click.UsageError("--plan lays every shard out anew: use it without --append, or with --append --refit")
    check_storage(cfg, reads=(SOURCE,), writes=(DATASET,))
    checked = _check_prepare(cfg, append=append, refit=refit, by_plan=by_plan)
    with _dataset_lease(cfg) as lease, prepare_engine(cfg) as eng:
        manifest = _prepare(cfg, eng, append=append, refit=refit, by_plan=by_plan, lease=lease, checked=checked)
    for split, info in manifest.splits.items():
        console.print(f"  {split}: {info.rows:,} rows in {len(info.shards)} shards")
    if manifest.dropped_rows:
        console.print(f"  dropped {manifest.dropped_rows:,} row(s) that could not be used")


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False))
@_set_option
@click.option("--launcher", type=click.Choice(["spark", "dask", "local"]), help="Overrides training.launcher.")
@click.option("--world-size", type=int, help="Overrides training.world_size.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in training.checkpoint_dir "
              "(wherever it is stored); the same as --set training.resume=true.")
@click.option("--allow-changed", "allow_changed", multiple=True, metavar="FIELDS",
              help="With --resume: fingerprint fields that may differ from the checkpoint's (comma-separated, "
              "repeatable: lr, weight_decay, lr_schedule, warmup_steps, epochs, dataset_version); adds to "
              "training.resume_allow_changed.")
def train(config, overrides, launcher, world_size, resume, allow_changed):
    """Train on a prepared dataset; track in MLflow; register the model."""
    extra = [f"training.launcher='{launcher}'"] if launcher else []
    extra += [f"training.world_size={world_size}"] if world_size else []
    extra += ["training.resume=true"] if resume else []
    cfg = load_config(config, list(overrides) + extra)
    if allow_changed:
        named = [f.strip() for arg in allow_changed for f in arg.split(",") if f.strip()]
        t = cfg.training
        cfg = cfg.model_copy(update={"training": t.model_copy(
            update={"resume_allow_changed": [*t.resume_allow_changed, *named]})})
    cfg = resolve_paths(cfg, [cfg.training.launcher], (DATASET, CHECKPOINTS), tracking=True)
    check_storage(cfg, reads=(DATASET,), writes=(CHECKPOINTS,))
    from shardline.training.checkpoints import check_allowed
    from shardline.training.job import check_checkpoints, hold_checkpoint_dir, preflight

    check_allowed(cfg.training.resume_allow_changed, "--allow-changed / training.resume_allow_changed")
    # One job per checkpoint directory: a second is refused here, before an engine starts,
    # and first: "in use by" says more than what the holder's checkpoints differ in.
    lease = hold_checkpoint_dir(cfg.training)
    try:
        # Names, the dataset, world size vs shards, batch vs rows, checkpoint_dir: one line
        # before an engine starts (the cluster's free slots are checked once it runs).
        check_checkpoints(cfg.training, preflight(cfg.training, cfg.pipelines.dataset_dir))
        if cfg.training.launcher == "dask":
            with open_dask(cfg) as client:
                result = _train(cfg, None, client, lease)
        else:
            spark = open_spark(cfg, spark_ranks(cfg)) if cfg.training.launcher == "spark" else None
            result = _train(cfg, spark, None, lease)
    finally:
        lease.release()
    console.print(f"  run {result.run_id}; model {result.model_uri}")
    for k in ("val_loss", "val_accuracy", "val_rmse", "val_mae", "val_r2"):
        if k in result.metrics:
            console.print(f"  {k} {result.metrics[k]:.4f}")


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False), required=False)
@_set_option
@click.option("--model", "model_uri", help="MLflow model URI; overrides serving.model_uri.")
@click.option(
    "--input",
    "input_path",
    help="Prepared dataset dir (its --split is scored) or raw Parquet file/dir/glob; "
    "default pipelines.dataset_dir.",
)
@click.option("--split", help="Split of a prepared dataset; overrides serving.split.")
@click.option("--output", "output_dir", help="Output directory; overrides serving.output_dir.")
@click.option("--engine", type=click.Choice(["spark", "dask"]), help="Overrides serving.engine.")
@click.option("--incremental", is_flag=True, help="Score only input files the output's ledger lacks.")
@click.option(
    "--backfill",
    type=click.Choice(["all", "new"]),
    help="With --incremental: input files earlier versions of the model scored and this version "
    "has not: 'new' leaves them (scores only files no version has), 'all' scores them too. "
    "Overrides serving.backfill (default new). A run that is not incremental scores them all.",
)
@click.option("--force", is_flag=True, help="Discard the output's scores (every model and version, "
              "each named as it is discarded); score all.")
@click.option("--status", "status_dir", metavar="OUTPUT",
              help="Print, per model version in OUTPUT, units and rows scored and what is pending "
              "(of --input if given), then exit. Starts no engine.")
def score(config, overrides, model_uri, input_path, split, output_dir, engine, incremental, backfill, force,
          status_dir):
    """Batch-score with a registered model on Spark or Dask, exactly once per input file and
    model version (OUTPUT/model=NAME/version=V/)."""
    cfg = load_config(config, list(overrides))
    update = {"model_uri": model_uri, "split": split, "output_dir": output_dir, "engine": engine,
              "backfill": backfill}
    update = {k: v for k, v in update.items() if v}
    if incremental:
        update["incremental"] = True
    cfg.serving = cfg.serving.model_copy(update=update)
    if status_dir:
        _score_status(cfg, status_dir, input_path)
        return
    if backfill and not cfg.serving.incremental:
        raise click.UsageError("--backfill applies to --incremental (scheduled) runs; a run that is "
                               "not incremental scores every input file this model version has not")
    cfg = resolve_paths(cfg, [cfg.serving.engine], (DATASET, OUTPUT), tracking=True)
    s = cfg.serving
    if not s.model_uri:
        raise click.UsageError("no model: pass --model or set serving.model_uri")
    from shardline.pipelines.storage import resolve
    from shardline.serving.score import execute, plan

    input_path = resolve(input_path, "--input", cluster_of(cfg, [s.engine])) if input_path else cfg.pipelines.dataset_dir
    check_storage(cfg, writes=(OUTPUT,), other_reads=(("--input", input_path),))
    # The output's lease first (a second job is refused at once, exit 75), then every check
    # and the plan, read-only; an engine starts only when there is something to score.
    with _output_lease(s.output_dir) as lease:
        p = plan(s.model_uri, cfg.tracking.resolved_uri(), input_path, s.output_dir, split=s.split,
                 incremental=s.incremental, backfill=s.backfill, force=force)
        for line in p.describe_discard():
            console.print(f"  [yellow]{escape(line)}[/]")
        if not p.todo:
            console.print(f"  {p.nothing_to_do()}")
            return
        with engine_handle(cfg, s.engine) as handle, stage(
            f"Scoring {len(p.todo)} file(s) of {input_path} with {p.describe_model()} on {s.engine}"
        ):
            r = execute(p, s.engine, handle, batch_size=s.batch_size, threads_per_task=s.threads_per_task,
                        lease=lease)
    left = f"; {r.files_left} scored by other versions only (--backfill all scores them)" if r.files_left else ""
    console.print(
        f"  {r.rows:,} rows from {r.files_scored} file(s) → {r.version_dir}; "
        f"{r.files_skipped} already scored{left}"
    )


def _score_status(cfg: ShardlineConfig, output_dir: str, input_path: str | None) -> None:
    from shardline.pipelines.storage import resolve
    from shardline.serving.inputs import list_units
    from shardline.serving.status import output_status

    out = resolve(output_dir, "--status")
    reads = [("--status", out)]
    if input_path:
        input_path = resolve(input_path, "--input")
        reads.append(("--input", input_path))
    check_storage(cfg, other_reads=tuple(reads))
    st = output_status(out, list_units(input_path, cfg.serving.split) if input_path else None)
    pending_of = f"of {input_path}" if input_path else "scored by another version"
    table = Table(title=f"scores in {st.output_dir}")
    for col in ("model", "version", "units", "rows", "last scored (UTC)", f"pending ({pending_of})", "interrupted"):
        table.add_column(col, justify="right" if col in ("units", "rows", "interrupted") else "left")
    for v in st.versions:
        version = f"{v.model_version} (flat layout)" if v.legacy else v.model_version
        table.add_row(v.model_name, version, f"{v.units:,}", f"{v.rows:,}", v.last_scored_at[:19],
                      f"{v.pending:,}", f"{v.interrupted:,}")
    Console(highlight=False).print(table)
    if not st.versions:
        print(f"{st.output_dir}: no scores yet")
    if st.new_units is not None:
        print(f"{st.new_units} file(s) of {input_path} not scored by any version yet")
    if st.holder and st.stale:
        print(f"no job is writing it now: {st.holder} left its lease ({st.stale}); the next run takes it over")
    else:
        print(f"being written now by {st.holder}" if st.holder else "no job is writing it now")


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False))
@_set_option
@click.option("--trials", type=int, help="Overrides sweep.trials (in all, a resumed sweep's earlier ones included).")
@click.option("--parallel", type=int, help="Overrides sweep.parallel: trials running at once.")
@click.option("--engine", type=click.Choice(["spark", "dask", "local"]), help="Overrides sweep.engine.")
@click.option("--name", help="Overrides sweep.name; an existing sweep's name resumes it.")
def sweep(config, overrides, trials, parallel, engine, name):
    """Search hyperparameters with Optuna; trials are MLflow child runs; register the best."""
    extra = [f"sweep.trials={trials}"] if trials is not None else []
    extra += [f"sweep.parallel={parallel}"] if parallel is not None else []
    extra += [f"sweep.engine='{engine}'"] if engine else []
    extra += [f"sweep.name={json.dumps(name)}"] if name is not None else []
    cfg = load_config(config, list(overrides) + extra)
    cfg = resolve_paths(cfg, [cfg.sweep.engine or cfg.training.launcher], (DATASET, CHECKPOINTS),
                        tracking=True, sweep=True)
    check_storage(cfg, reads=(DATASET,), writes=(CHECKPOINTS,))
    from shardline.training.sweep import check_sweep, run_sweep

    check_sweep(cfg.sweep, cfg.training, cfg.pipelines.dataset_dir)  # before any engine starts
    where = cfg.sweep.engine or cfg.training.launcher
    args = (cfg.sweep, cfg.training, cfg.tracking, cfg.pipelines.dataset_dir)
    with stage(f"Sweep '{cfg.sweep.name}' on {where}"):
        if where == "local":
            r = run_sweep(*args)
        else:
            with engine_handle(cfg, where, spark_ranks(cfg, where, cfg.sweep.world_size)) as handle:
                r = run_sweep(*args, **{"spark" if where == "spark" else "dask_client": handle})

    table = Table(title=f"shardline sweep {r.name}", show_header=False, title_justify="left")
    counts = ", ".join(f"{r.count(s)} {s}" for s in ("complete", "pruned", "failed"))
    table.add_row("trials", f"{counts} ({r.ran} run now)")
    if r.best:
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.best.params.items())
        table.add_row("best trial", f"{r.best.number}: {r.objective} {r.best.value:.4f} ({params})")
        table.add_row("model", f"{r.model_uri} (version {r.model_version})")
    else:
        table.add_row("model", "none registered: no trial completed")
    table.add_row("MLflow parent run", r.parent_run_id)
    table.add_row("Optuna storage", r.storage)
    Console().print(table)


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False))
@_set_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object, nothing else.")
def plan(config, overrides, as_json):
    """Measure training and loader samples/s; choose loader workers, shards and row groups
    so loading >= 1.2 x training; store the plan in the dataset's manifest.

    Then `shardline prepare CONFIG --plan` lays the shards out by it, and training
    uses its loader workers unless training.loader_workers is set.
    """
    cfg = resolve_paths(load_config(config, list(overrides)), [])  # measured here, in this process
    check_storage(cfg, writes=(DATASET,))
    from shardline.pipelines.manifest import manifest_url, store_plan
    from shardline.pipelines.storage import display
    from shardline.training.job import preflight
    from shardline.training.plan import plan_dataset

    t, where = cfg.training, cfg.pipelines.dataset_dir
    preflight(t, where)  # no dataset, bad settings: one line, before the stage starts
    with stage(f"Measuring {t.model} {t.hidden} and the loader on {where}"):
        measured, p = plan_dataset(t, where)
    manifest = store_plan(where, measured.version_id, p)
    if as_json:
        click.echo(p.model_dump_json())
        return

    train = manifest.split("train")
    now_groups = {s.row_groups for s in train.shards}
    table = Table(title=f"shardline plan, {p.world_size} data-parallel ranks, local batch {p.local_batch}",
                  show_header=False, title_justify="left")
    table.add_row("measured on", f"{p.device}: {p.model}")
    table.add_row("training (measured)", f"{p.train_samples_per_s:,.0f} samples/s per rank "
                  "(compute only, no all-reduce: an upper bound)")
    table.add_row("loader (measured)", f"{p.loader_samples_per_s_per_worker:,.0f} samples/s per worker "
                  f"(rank 0's train shards, {manifest.layout.rows_per_row_group:,} rows/row group)")
    table.add_row("target", f"loading ≥ {p.headroom} × training = "
                  f"{p.headroom * p.train_samples_per_s:,.0f} samples/s per rank")
    table.add_row("loader workers per rank", f"{p.loader_workers_per_rank} (needs "
                  f"{p.required_loader_workers}; cap {p.max_loader_workers_per_rank} = cores per rank)")
    table.add_row("loading (predicted)", f"{p.loading_samples_per_s:,.0f} samples/s per rank: target "
                  f"{'met' if p.target_met else '[red]NOT met[/]'}")
    table.add_row("predicted data-wait", f"{p.predicted_data_wait:.0%} of step time")
    table.add_row("train shards", f"{p.shards_per_rank} per rank = {p.shards_per_rank * p.world_size} "
                  f"(now {len(train.shards)})")
    table.add_row("rows per row group", f"{p.rows_per_row_group:,} (now {manifest.layout.rows_per_row_group:,}; "
                  f"{max(now_groups)} per train shard)")
    table.add_row("stored in", display(manifest_url(where, manifest.sequence)))
    Console().print(table)
    if not p.target_met:
        console.print(f"  loading cannot reach {p.headroom} × training with {p.max_loader_workers_per_rank} "
                      f"worker(s) per rank: expect the predicted data-wait, or use fewer ranks per machine")
    console.print(f"  lay shards out by it: shardline prepare {config} --plan")


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False), required=False)
@_set_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the UI listens on; loopback unless you mean to share it (it has no login).")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(1, 65535), help="Port of the UI.")
def ui(config, overrides, host, port):
    """The MLflow UI on the configured store (tracking.tracking_uri): an MLflow server on a
    SQLite/database store, bound to loopback; a server URL is checked and printed."""
    from .ui import serve

    cfg = resolve_paths(load_config(config, list(overrides)), [])
    serve(cfg.tracking.tracking_uri, host, port, lambda line: console.print(escape(line)))


def _dataset_lease(cfg: ShardlineConfig):
    from shardline.pipelines.manifest import check_dataset_dir
    from shardline.pipelines.prepare import dataset_lease

    check_dataset_dir(cfg.pipelines.dataset_dir)  # a foreign directory: refused before we write
    return dataset_lease(cfg.pipelines.dataset_dir)


def _output_lease(output_dir: str):
    from shardline.serving.ledger import check_output_dir, output_lease

    check_output_dir(output_dir)
    return output_lease(output_dir)


def _check_prepare(cfg: ShardlineConfig, **how):
    """Input, columns and feature spec, checked before an engine starts; says what it inferred."""
    from shardline.pipelines.checks import check_prepare

    checked = check_prepare(cfg.pipelines, **how)
    for note in checked.notes:
        console.print(f"  {escape(note)}")
    return checked


def _prepare(cfg: ShardlineConfig, engine, append=False, refit=False, by_plan=False, lease=None, checked=None):
    from shardline.pipelines.prepare import prepare

    src = cfg.pipelines.source
    what = f"{src.synthetic.rows:,} synthetic rows" if src.format == "synthetic" else src.path
    how = " by its bandwidth plan" if by_plan else ""
    with stage(f"Preparing {what} into {cfg.pipelines.dataset_dir}{how} with {engine.name}"):
        manifest = prepare(engine, cfg.pipelines, append=append, refit=refit, by_plan=by_plan, lease=lease,
                           checked=checked)
    spec = manifest.feature_spec
    if spec.task == "classification" and spec.classes is None:
        console.print(
            f"  pipelines.features.classes = {manifest.statistics.num_classes}  "
            "(inferred: the largest label + 1; declare it to have other labels refused)"
        )
    return manifest


def _train(cfg: ShardlineConfig, spark, dask_client=None, lease=None):
    from shardline.training.job import run_training

    t = cfg.training
    title = f"Training {t.model} with {t.strategy} on {t.world_size} {t.launcher} ranks"
    console.print(f"  checkpoints: {escape(t.checkpoint_dir)}")
    with stage(title):
        return run_training(
            t, cfg.tracking, cfg.pipelines.dataset_dir, spark=spark, dask_client=dask_client, lease=lease
        )


def _score(cfg, engine: str, handle, model_uri: str, tracking_uri: str, input_path: str, force=False, lease=None):
    from shardline.serving.score import score as score_input

    s = cfg.serving
    with stage(f"Scoring {input_path} with {model_uri} on {engine}"):
        return score_input(
            engine, handle, model_uri, tracking_uri, input_path, s.output_dir,
            split=s.split, incremental=s.incremental, backfill=s.backfill, force=force, batch_size=s.batch_size,
            threads_per_task=s.threads_per_task, lease=lease,
        )


cli.add_command(bench)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="shardline", standalone_mode=False)
    except click.exceptions.Abort:
        console.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except ShardlineError as e:
        # escape: messages quote settings like [pipelines] that rich would eat as markup
        console.print(f"[red]error:[/] {escape(str(e))}")
        sys.exit(e.exit_code)
    except OSError as e:
        from shardline.pipelines.failures import describe, is_permanent

        if not is_permanent(e):
            raise  # a bug, or a hiccup worth its traceback
        # A full disk or no permission met on the driver itself (a lease, a manifest): one line.
        console.print(f"[red]error:[/] {escape(describe(e))}")
        sys.exit(1)


if __name__ == "__main__":
    main()
