"""The `shardline` command: parse, call, report. No logic of its own."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager

import click
from rich.console import Console
from rich.table import Table

from pipelines.errors import ShardlineError

from .config import ShardlineConfig, load_config

console = Console(stderr=True, highlight=False)

_set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.FIELD=VALUE",
    help="Override any config field, e.g. --set training.epochs=3 (repeatable).",
)


@contextmanager
def stage(title: str):
    """One line when a stage starts and one when it ends, with its wall time."""
    console.print(f"[bold]→[/] {title} …")
    start = time.perf_counter()
    yield
    console.print(f"[green]✓[/] {title} [dim]({time.perf_counter() - start:.1f} s)[/]")


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
    spark = _spark(cfg)
    from pipelines.engine_spark import SparkEngine

    manifest = _prepare(cfg, SparkEngine(spark))
    result = _train(cfg, spark)
    # force: each run trains a new model version and re-scores its own output with it.
    score = _score(
        cfg, "spark", spark, result.model_uri, result.tracking_uri, cfg.pipelines.dataset_dir,
        force=True,
    )

    table = Table(title="shardline run", show_header=False, title_justify="left")
    for split, info in manifest.splits.items():
        table.add_row(f"rows {split}", f"{info.rows:,} in {len(info.shards)} shards")
    if "val_accuracy" in result.metrics:
        table.add_row("val accuracy", f"{result.metrics['val_accuracy']:.4f}")
    table.add_row("MLflow run", result.run_id)
    table.add_row("MLflow store", result.tracking_uri)
    table.add_row("model", f"{result.model_uri}")
    table.add_row("dataset", cfg.pipelines.dataset_dir)
    table.add_row("scores", f"{score.output_dir} ({score.rows:,} rows)")
    table.add_row("open the UI", f"mlflow ui --backend-store-uri {result.tracking_uri}")
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
def prepare(config, overrides, engine, append, refit):
    """Validate, split, transform and shard raw data into a prepared dataset."""
    extra = [f"pipelines.engine='{engine}'"] if engine else []
    cfg = load_config(config, list(overrides) + extra)
    if refit and not append:
        raise click.UsageError("--refit goes with --append")
    with _prepare_engine(cfg) as eng:
        manifest = _prepare(cfg, eng, append=append, refit=refit)
    for split, info in manifest.splits.items():
        console.print(f"  {split}: {info.rows:,} rows in {len(info.shards)} shards")
    if manifest.dropped_rows:
        console.print(f"  dropped {manifest.dropped_rows:,} row(s) that did not parse")


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False))
@_set_option
@click.option("--launcher", type=click.Choice(["spark", "dask", "local"]), help="Overrides training.launcher.")
@click.option("--world-size", type=int, help="Overrides training.world_size.")
def train(config, overrides, launcher, world_size):
    """Train on a prepared dataset; track in MLflow; register the model."""
    extra = [f"training.launcher='{launcher}'"] if launcher else []
    extra += [f"training.world_size={world_size}"] if world_size else []
    cfg = load_config(config, list(overrides) + extra)
    if cfg.training.launcher == "dask":
        with _dask(cfg) as client:
            result = _train(cfg, None, client)
    else:
        result = _train(cfg, _spark(cfg) if cfg.training.launcher == "spark" else None)
    console.print(f"  run {result.run_id}; model {result.model_uri}")
    for k in ("val_loss", "val_accuracy"):
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
@click.option("--force", is_flag=True, help="Discard the output's scores (any model); score all.")
def score(config, overrides, model_uri, input_path, split, output_dir, engine, incremental, force):
    """Batch-score with a registered model on Spark or Dask, exactly once per input file."""
    cfg = load_config(config, list(overrides))
    update = {"model_uri": model_uri, "split": split, "output_dir": output_dir, "engine": engine}
    update = {k: v for k, v in update.items() if v}
    if incremental:
        update["incremental"] = True
    cfg.serving = s = cfg.serving.model_copy(update=update)
    if not s.model_uri:
        raise click.UsageError("no model: pass --model or set serving.model_uri")
    with _engine_handle(cfg, s.engine) as handle:
        r = _score(
            cfg, s.engine, handle, s.model_uri, cfg.tracking.resolved_uri(),
            input_path or cfg.pipelines.dataset_dir, force=force,
        )
    console.print(
        f"  {r.rows:,} rows from {r.files_scored} file(s) → {r.output_dir}; "
        f"{r.files_skipped} already scored"
    )


@cli.group()
def bench():
    """Benchmarks: each prints its figure and a baseline measured in the same run."""


@bench.command("prepare")
@click.option("--rows", type=int, default=1_000_000, show_default=True, help="Synthetic rows.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
def bench_prepare(rows, as_json):
    """Prepare MB/s on Spark and on Dask vs a single-process pyarrow rewrite."""
    from benchmarks.prepare import run as run_bench

    result = run_bench(rows, progress=lambda msg: console.print(f"[dim]… {msg}[/]"))
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"prepare, {rows:,} rows, {result['input_mb']} MB raw Parquet, {result['cores']} cores")
    for col in ("", "seconds", "MB/s", "× pyarrow"):
        table.add_column(col, justify="right")
    for k in ("pyarrow", "spark", "dask"):
        ratio = result["ratio_vs_pyarrow"].get(k, 1.0)
        table.add_row(k, f"{result['seconds'][k]:.2f}", f"{result['mb_per_s'][k]:.1f}", f"{ratio:.2f}")
    Console().print(table)


def _spark(cfg: ShardlineConfig):
    from pipelines.engines import spark_session

    with stage("Starting Spark"):
        spark = spark_session(cfg.spark)
    # Under spark-submit its --master wins over the config's: say which one runs.
    console.print(f"  Spark master {spark.sparkContext.master}")
    return spark


@contextmanager
def _engine_handle(cfg: ShardlineConfig, engine: str):
    """The SparkSession, or a Dask client (closed, with its embedded cluster, after)."""
    if engine == "spark":
        yield _spark(cfg)
        return
    with _dask(cfg) as client:
        yield client


@contextmanager
def _prepare_engine(cfg: ShardlineConfig):
    from pipelines.engine_dask import DaskEngine
    from pipelines.engine_spark import SparkEngine

    wrap = SparkEngine if cfg.pipelines.engine == "spark" else DaskEngine
    with _engine_handle(cfg, cfg.pipelines.engine) as handle:
        yield wrap(handle)


@contextmanager
def _dask(cfg: ShardlineConfig):
    from pipelines.engines import dask_client

    where = cfg.dask.address or f"LocalCluster of {cfg.dask.n_workers} workers"
    with stage(f"Starting Dask ({where})"):
        client = dask_client(cfg.dask)
    cluster = None if cfg.dask.address else client.cluster
    try:
        yield client
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _prepare(cfg: ShardlineConfig, engine, append: bool = False, refit: bool = False):
    from pipelines.prepare import prepare

    src = cfg.pipelines.source
    what = f"{src.synthetic.rows:,} synthetic rows" if src.format == "synthetic" else src.path
    with stage(f"Preparing {what} into {cfg.pipelines.dataset_dir} with {engine.name}"):
        return prepare(engine, cfg.pipelines, append=append, refit=refit)


def _train(cfg: ShardlineConfig, spark, dask_client=None):
    from training.job import run_training

    t = cfg.training
    title = f"Training {t.model} with {t.strategy} on {t.world_size} {t.launcher} ranks"
    with stage(title):
        return run_training(
            t, cfg.tracking, cfg.pipelines.dataset_dir, spark=spark, dask_client=dask_client
        )


def _score(cfg, engine: str, handle, model_uri: str, tracking_uri: str, input_path: str, force=False):
    from serving.score import score as score_input

    s = cfg.serving
    with stage(f"Scoring {input_path} with {model_uri} on {engine}"):
        return score_input(
            engine, handle, model_uri, tracking_uri, input_path, s.output_dir,
            split=s.split, incremental=s.incremental, force=force, batch_size=s.batch_size,
        )


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
        console.print(f"[red]error:[/] {e}", soft_wrap=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
