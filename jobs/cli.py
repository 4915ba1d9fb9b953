"""The `shardline` command: parse, call the Python API (shardline.api), report. No logic of its own."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardline import api
from shardline.foundation.errors import ShardlineError
from shardline.foundation.redact import redact

from shardline.config import (
    ShardlineConfig,
    load_config,
    resolve_paths,
)
from shardline.foundation import report
from shardline.foundation.storage import display
from shardline.pipelines.manifest import manifest_url

from .cli_bench import bench
from .cli_forecast import print_forecast
from .cli_json import json_file_option as _json_file_option
from .cli_json import json_file_path, write_json_file
from .cli_json import json_option as _json_option
from .cli_json import json_out as _json_out
from .console import ConsoleReporter, console
from .ui import serve, ui_hint

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
@click.option("--force", is_flag=True, help="Discard the output's scores (every model and version, each "
              "named as it is discarded) before scoring; without it the new version's scores join the "
              "earlier versions' in serving.output_dir.")
@_json_option
def run(config, overrides, force, as_json):
    """Generate/prepare data (pipelines.engine), train (training.launcher), register the
    model, and score with it (serving.engine): each stage on the engine its setting names."""
    with _json_out(as_json) as emit:
        r = api.run(config, list(overrides), force=force)
        emit(r)
    if as_json:
        return
    manifest, result, score = r.prepare.manifest, r.train, r.score
    table = Table(title="shardline run", show_header=False, title_justify="left")
    for split, info in manifest.splits.items():
        table.add_row(f"rows {split}", f"{info.rows:,} in {len(info.shards)} shards")
    for k in ("val_accuracy", "val_rmse", "val_r2"):
        if k in result.metrics:
            table.add_row(k.replace("_", " "), f"{result.metrics[k]:.4f}")
    table.add_row("MLflow run", result.run_id)
    table.add_row("MLflow store", redact(result.tracking_uri))
    table.add_row("model", f"{result.model_uri or 'none registered (the loop called no ctx.register)'}")
    table.add_row("dataset", r.prepare.dataset_dir)
    table.add_row("scores", f"{score.version_dir} ({score.rows:,} rows)" if score.engine else score.note)
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
@_json_option
def prepare(config, overrides, engine, append, refit, by_plan, as_json):
    """Validate, split, transform and shard raw data into a prepared dataset."""
    if refit and not append:
        raise click.UsageError("--refit goes with --append")
    if by_plan and append and not refit:
        raise click.UsageError("--plan lays every shard out anew: use it without --append, or with --append --refit")
    extra = [f"pipelines.engine='{engine}'"] if engine else []
    with _json_out(as_json) as emit:
        r = api.prepare(config, list(overrides) + extra, append=append, refit=refit, by_plan=by_plan)
        emit(r)
    for split, info in r.manifest.splits.items():
        console.print(f"  {split}: {info.rows:,} rows in {len(info.shards)} shards")
    if r.manifest.dropped_rows:
        console.print(f"  dropped {r.manifest.dropped_rows:,} row(s) that could not be used")
    if r.manifest.imputed_values:
        by_col = ", ".join(f"{c} {n:,}" for c, n in r.manifest.imputed_values.items())
        console.print(f"  imputed {sum(r.manifest.imputed_values.values()):,} NaN, inf or null feature "
                      f"value(s) with the train mean ({escape(by_col)})")


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False))
@_set_option
@click.option("--launcher", type=click.Choice(["spark", "dask", "local"]), help="Overrides training.launcher.")
@click.option("--world-size", type=int, help="Overrides training.world_size.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in training.checkpoint_dir "
              "(wherever it is stored); the same as --set training.resume=true.")
@click.option("--allow-changed", "allow_changed", multiple=True, metavar="FIELDS",
              help="With --resume: fingerprint fields that may differ from the checkpoint's (comma-separated, "
              "repeatable: lr, weight_decay, lr_schedule, warmup_steps, epochs, dataset_version, code); adds to "
              "training.resume_allow_changed.")
@_json_option
def train(config, overrides, launcher, world_size, resume, allow_changed, as_json):
    """Train on a prepared dataset on training.launcher's engine; track in MLflow; register the model."""
    extra = [f"training.launcher='{launcher}'"] if launcher else []
    extra += [f"training.world_size={world_size}"] if world_size else []
    extra += ["training.resume=true"] if resume else []
    cfg = api.load_config(config, list(overrides) + extra)
    if allow_changed:
        named = [f.strip() for arg in allow_changed for f in arg.split(",") if f.strip()]
        cfg = api.load_config(cfg, {"training.resume_allow_changed": [*cfg.training.resume_allow_changed, *named]})
    with _json_out(as_json) as emit:
        result = api.train(cfg)
        emit(result)
    console.print(f"  run {result.run_id}; model {result.model_uri or 'none registered (the loop called no ctx.register)'}")
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
@_json_option
def score(config, overrides, model_uri, input_path, split, output_dir, engine, incremental, backfill, force,
          status_dir, as_json):
    """Batch-score with a registered model on Spark or Dask, exactly once per input file and
    model version (OUTPUT/model=NAME/version=V/)."""
    cfg = api.load_config(config, list(overrides))
    update = {"model_uri": model_uri, "split": split, "output_dir": output_dir, "engine": engine,
              "backfill": backfill}
    update = {f"serving.{k}": v for k, v in update.items() if v}
    if incremental:
        update["serving.incremental"] = True
    cfg = api.load_config(cfg, update)
    if status_dir:
        _score_status(cfg, status_dir, input_path, as_json)
        return
    if backfill and not cfg.serving.incremental:
        raise click.UsageError("--backfill applies to --incremental (scheduled) runs; a run that is "
                               "not incremental scores every input file this model version has not")
    if not cfg.serving.model_uri:
        raise click.UsageError("no model: pass --model or set serving.model_uri")
    with _json_out(as_json) as emit:
        r = api.score(cfg, input_path=input_path, force=force)
        emit(r)
    if r.engine is None:
        console.print(f"  {r.note}")
        return
    left = f"; {r.files_left} scored by other versions only (--backfill all scores them)" if r.files_left else ""
    console.print(
        f"  {r.rows:,} rows from {r.files_scored} file(s) → {r.version_dir}; "
        f"{r.files_skipped} already scored{left}"
    )


def _score_status(cfg: ShardlineConfig, output_dir: str, input_path: str | None, as_json: bool) -> None:
    with _json_out(as_json) as emit:
        st = api.score_status(cfg, output_dir=output_dir, input_path=input_path)
        emit(st)
    if as_json:
        return
    pending_of = f"of {input_path}" if input_path else "scored by another version"
    table = Table(title=f"scores in {st.output_dir}")
    for col in ("model", "version", "units", "rows", "last scored (UTC)", f"pending ({pending_of})", "interrupted"):
        table.add_column(col, justify="right" if col in ("units", "rows", "interrupted") else "left")
    for v in st.versions:
        table.add_row(v.model_name, v.model_version, f"{v.units:,}", f"{v.rows:,}", v.last_scored_at[:19],
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
    r = api.sweep(config, list(overrides) + extra)

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
@click.argument("config", type=click.Path(dir_okay=False), required=False)
@_set_option
@click.option("--hosts", type=click.IntRange(min=1), help="Forecast for this many hosts (with --cores).")
@click.option("--cores", type=click.IntRange(min=1), help="Cores per host of the forecast.")
@click.option("--gpus", type=click.IntRange(min=0), default=0, show_default=True, help="GPUs per host of the forecast.")
@click.option("--sample-rows", type=click.IntRange(min=1000), default=None,
              help="With --hosts: rows of the source measured on [default: 300,000].")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object, nothing else.")
@_json_file_option
def plan(config, overrides, hosts, cores, gpus, sample_rows, as_json):
    """Measure training and loader samples/s; choose loader workers, shards and row groups
    so loading >= 1.2 x training; store the plan in the dataset's manifest.

    Then `shardline prepare CONFIG --plan` lays the shards out by it, and training
    uses its loader workers unless training.loader_workers is set.

    With --hosts H --cores C: the run's cost before it starts. Per-core rates measured on
    a sample of the source (seconds), then the wall time, driver memory and per-worker
    memory of prepare, an epoch and scoring on H x C, and the layout it would pick; stored
    beside the dataset and logged to MLflow by the next training run.
    """
    if hosts or cores:
        if not (hosts and cores):
            raise click.UsageError("--hosts and --cores go together")
        r = api.forecast(config, list(overrides), hosts=hosts, cores=cores, gpus=gpus, sample_rows=sample_rows)
        if json_file_path():
            write_json_file(json_file_path(), r.to_dict())
        if as_json:
            click.echo(json.dumps(r.to_dict()))
        else:
            print_forecast(r)
        return
    if config is None:
        raise click.UsageError("Missing argument 'CONFIG' (or give --hosts and --cores for a forecast)")
    r = api.plan(config, list(overrides))  # measured here, in this process
    manifest, p = r.manifest, r.plan
    if json_file_path():
        write_json_file(json_file_path(), p.model_dump(mode="json"))
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
    table.add_row("stored in", display(manifest_url(r.dataset_dir, manifest.sequence)))
    Console().print(table)
    click.echo(r.grid)  # plain text: its columns are aligned already
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
    cfg = resolve_paths(load_config(config, list(overrides)), [])
    serve(cfg.tracking.tracking_uri, host, port, lambda line: console.print(escape(line)))


cli.add_command(bench)


def main(argv: list[str] | None = None) -> None:
    # The library reports through foundation.report; the command shows it on its console
    # (and puts the caller's reporter back: a test or a notebook may call main in-process).
    with report.using(ConsoleReporter()):
        _main(argv)


def _main(argv: list[str] | None) -> None:
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
        # redact: the last line is what lands in CI logs; no URI password gets there, whichever
        # code wrote the message
        console.print(f"[red]error:[/] {escape(redact(str(e)))}")
        sys.exit(e.exit_code)
    except OSError as e:
        from shardline.foundation.failures import describe, is_permanent

        if not is_permanent(e):
            raise  # a bug, or a hiccup worth its traceback
        # A full disk or no permission met on the driver itself (a lease, a manifest): one line.
        console.print(f"[red]error:[/] {escape(redact(describe(e)))}")
        sys.exit(1)


if __name__ == "__main__":
    main()
