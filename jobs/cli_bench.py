"""`shardline bench …`: each benchmark prints its figures beside a baseline measured in
the same run, as ratios (the numbers come from `benchmarks/`)."""

from __future__ import annotations

import json
import sys
from contextlib import redirect_stdout

import click
from rich.console import Console
from rich.table import Table

from shardline.benchmarks.fsdp_limit import run as run_fsdp_limit
from shardline.benchmarks.loader import run as run_loader
from shardline.benchmarks.loader_images import run as run_loader_images
from shardline.benchmarks.loader_s3 import run as run_loader_s3
from shardline.benchmarks.strategies import run as run_strategies
from shardline.benchmarks.train import run as run_train
from shardline.foundation.errors import ShardlineError
from shardline.foundation.storage import check_access, resolve

from .cli_bench_scale import scale_options
from .cli_bench_strategies import print_fsdp_limit, print_sharding, print_strategies
from .console import console

# Imported inside the functions that use them: benchmarks.prepare (imports pandas); benchmarks.score (imports
# MLflow, pandas).

IMAGES_DEFAULT = 512  # `bench loader --images`: a few hundred small images


@click.group()
def bench():
    """Benchmarks: each prints its figure and a baseline measured in the same run."""


def _bench(run_bench, as_json: bool, **kwargs) -> dict | None:
    """Run a benchmark with progress lines; with --json print its one object and return None."""
    result = run_bench(progress=lambda msg: console.print(f"[dim]… {msg}[/]"), **kwargs)
    if as_json:
        click.echo(json.dumps(result))
        return None
    return result


@bench.command("prepare")
@click.option("--rows", type=int, default=1_000_000, show_default=True, help="Synthetic rows.")
@click.option("--rounds", type=int, default=1, show_default=True,
              help="Runs of every job, interleaved; each keeps its best.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
def bench_prepare(rows, rounds, as_json):
    """Prepare MB/s on Spark and Dask vs native Spark SQL, native dask.dataframe and pyarrow."""
    from shardline.benchmarks.prepare import run as run_bench

    result = _bench(run_bench, as_json, rows=rows, rounds=rounds)
    if result is None:
        return
    table = Table(title=f"prepare, {rows:,} rows, {result['input_mb']:.1f} MB raw Parquet, {result['cores']} cores")
    for col in ("", "seconds", "MB/s", "× native", "× pyarrow"):
        table.add_column(col, justify="right")
    for k in ("pyarrow", "spark_native", "spark", "dask_native", "dask"):
        native = f"{result['ratio_vs_native'][k]:.2f}" if k in result["ratio_vs_native"] else ""
        ratio = result["ratio_vs_pyarrow"].get(k, 1.0)
        name = {"spark": "shardline spark", "dask": "shardline dask"}.get(k, k.replace("_", " "))
        table.add_row(name, f"{result['seconds'][k]:.2f}", f"{result['mb_per_s'][k]:.1f}", native, f"{ratio:.2f}")
    Console().print(table)


@bench.command("score")
@click.option("--rows", type=int, default=1_000_000, show_default=True, help="Synthetic rows (the train split is scored).")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Measured runs of every method, in rounds; each figure is its method's median run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
def bench_score(rows, rounds, as_json):
    """Scoring rows/s on Spark and Dask (prepared splits and raw rows) vs plain processes, the limit and predict_batch_udf."""
    from shardline.benchmarks.score import run as run_bench

    result = _bench(run_bench, as_json, rows=rows, rounds=rounds)
    if result is None:
        return
    table = Table(title=f"score, {result['rows_scored']:,} train rows, {result['cores']} cores, "
                        f"median of {result['rounds']} runs")
    for col in ("", "seconds", "rows/s", "× limit", "× processes", "× pbu"):
        table.add_column(col, justify="right")
    secs, rps = result["seconds"], result["rows_per_s"]
    for k in ("spark", "dask"):
        table.add_row(k, f"{secs[k]:.2f}", f"{rps[k]:,.0f}", f"{result['ratio_vs_limit'][k]:.2f}",
                      f"{result['ratio_vs_processes'][k]:.2f}", f"{result['ratio_vs_predict_batch_udf'][k]:.2f}")
    table.add_row("predict_batch_udf (pbu)", f"{secs['predict_batch_udf']:.2f}", f"{rps['predict_batch_udf']:,.0f}",
                  "", "", "")
    table.add_row(f"{result['cores']} processes, no engine", f"{secs['processes']:.2f}",
                  f"{rps['processes']:,.0f}", f"{result['processes_vs_limit']:.2f}", "", "")
    table.add_row(f"limit (1 proc × {result['cores']})", f"{secs['limit_single_process']:.2f}",
                  f"{rps['limit']:,.0f}", "", "", "")
    Console().print(table)
    raw = Table(title=f"score from raw rows (the model's transform inside), {result['rows_scored_raw']:,} rows")
    for col in ("", "seconds", "rows/s", "× processes", "× pbu"):
        raw.add_column(col, justify="right")
    for k in ("spark", "dask"):
        raw.add_row(k, f"{secs[k + '_raw']:.2f}", f"{rps[k + '_raw']:,.0f}",
                    f"{result['raw_ratio_vs_processes'][k]:.2f}", f"{result['raw_ratio_vs_predict_batch_udf'][k]:.2f}")
    raw.add_row("predict_batch_udf (pbu)", f"{secs['predict_batch_udf_raw']:.2f}",
                f"{rps['predict_batch_udf_raw']:,.0f}", "", "")
    raw.add_row(f"{result['cores']} processes, no engine", f"{secs['processes_raw']:.2f}",
                f"{rps['processes_raw']:,.0f}", "", "")
    Console().print(raw)
    t = result["targets"]

    def verdict(ratio: float, target: float, met: bool) -> str:
        return f"{ratio:.2f} (target ≥ {target}: {'met' if met else 'NOT met'})"

    for k in ("spark", "dask"):
        met = result["met"][k]
        console.print(
            f"  {k}: × limit {verdict(result['ratio_vs_limit'][k], t['vs_limit'], met['vs_limit'])}, "
            f"× processes {verdict(result['ratio_vs_processes'][k], t['vs_processes'], met['vs_processes'])}, "
            f"× predict_batch_udf {verdict(result['ratio_vs_predict_batch_udf'][k], t['vs_predict_batch_udf'], met['vs_predict_batch_udf'])}"
        )
        console.print(
            f"  {k} from raw rows: × processes "
            f"{verdict(result['raw_ratio_vs_processes'][k], t['vs_processes'], met['raw_vs_processes'])}, "
            f"× predict_batch_udf {verdict(result['raw_ratio_vs_predict_batch_udf'][k], t['vs_predict_batch_udf'], met['raw_vs_predict_batch_udf'])}"
        )
    console.print(f"  {result['cores']} plain processes running the limit's loop reach "
                  f"{result['processes_vs_limit']:.2f} of the limit here: the machine's own parallel "
                  f"efficiency on this work, before any engine")


@bench.command("train")
@click.option("--rows", type=click.IntRange(min=1), default=None,
              help="Synthetic rows (the train split is read) [default: 100,000]; with --images, images "
              "to generate, with --tokens, sequences [default: one epoch of the steps].")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="DDP steps per step-time run [default: 200, 20 warm-up]; --images 48, --tokens 30, "
              "--loop 150 timed.")
@click.option("--rounds", type=click.IntRange(min=1), default=None,
              help="Step-time runs per launcher, the fastest counts [default: 3; --images 2, --tokens 3].")
@click.option("--images", "images", is_flag=True,
              help="A CNN on PNG images: shardline (plan, prepare, its loader, local and Spark) vs "
              "torchvision ImageFolder + DataLoader workers + DDP under torchrun.")
@click.option("--tokens", "tokens", is_flag=True,
              help="The built-in decoder on token sequences: shardline vs a nanoGPT-style uint16 memmap loop.")
@click.option("--loop", "loop", is_flag=True,
              help="One hand-written DDP loop under torchrun (its shards read into memory) and as a shardline "
              "loop (shardline.train(loop=...), ctx.loader): steps/s and data wait of both.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
def bench_train(rows, steps, rounds, images, tokens, loop, as_json):
    """DDP step time, launch to first step and all-reduce bytes/s: ours vs torchrun, TorchDistributor, raw;
    --images / --tokens: training throughput vs the loops users write by hand."""
    if images + tokens + loop > 1:
        raise click.UsageError("--images, --tokens and --loop are three benchmarks: give one")
    if loop:
        from .cli_bench_train import bench_train_loop

        bench_train_loop(rows, steps, rounds, as_json)
        return
    if images or tokens:
        from .cli_bench_train import bench_train_typed

        bench_train_typed("images" if images else "tokens", rows, steps, rounds, as_json)
        return

    rows, steps, rounds = rows or 100_000, steps or 200, rounds or 3
    # TorchDistributor relays its tasks' output with print(): keep stdout for the result.
    with redirect_stdout(sys.stderr):
        result = run_train(rows, progress=lambda msg: console.print(f"[dim]… {msg}[/]"),
                           steps=steps, warmup=min(20, steps // 2), rounds=rounds)
    if as_json:  # outside the redirect: the object goes to stdout
        click.echo(json.dumps(result))
        return
    m = result["model"]
    table = Table(title=f"train, DDP {result['world_size']} ranks × {result['threads_per_rank']} thread(s), "
                        f"mlp {m['hidden']}, global batch {result['global_batch']}, {result['steps']} steps")
    for col in ("", "ours", "baseline", "ratio"):
        table.add_column(col, justify="right")
    s, ls, ar = result["step_s"], result["launch_to_first_step_s"], result["allreduce"]
    table.add_row("step time vs torchrun", f"{s['spark'] * 1e3:.2f} ms", f"{s['torchrun'] * 1e3:.2f} ms",
                  f"{result['step_time_ratio']:.2f}")
    table.add_row("launch→1st step vs TorchDistributor", f"{ls['spark']:.2f} s",
                  f"{ls['torch_distributor']:.2f} s", f"{result['launch_ratio']:.2f}")
    table.add_row("launch→1st step vs torchrun", f"{ls['spark']:.2f} s", f"{ls['torchrun']:.2f} s",
                  f"{ls['torchrun'] / ls['spark']:.2f}")
    table.add_row(f"all-reduce {ar['bytes'] / 1e6:.2f} MB vs raw", f"{ar['ddp_bytes_per_s'] / 1e6:.0f} MB/s",
                  f"{ar['raw_bytes_per_s'] / 1e6:.0f} MB/s", f"{result['allreduce_ratio']:.2f}")
    Console().print(table)
    console.print(f"  ours: Spark barrier DDP; ratio > 1: ours better; all-reduce 1.0 = raw. Fastest of "
                  f"{result['rounds']} rounds; {ar['buckets']} DDP bucket(s); with waiting for the peer "
                  f"DDP's all-reduce is in flight {ar['ddp_in_flight_s_per_step'] * 1e3:.2f} ms/step")


@bench.command("loader")
@click.option("--rows", type=click.IntRange(min=1), default=None,
              help="Synthetic rows (the train split is read) [default: 1,000,000]; with --images, "
              f"images to generate [default: {IMAGES_DEFAULT}].")
@click.option("--images", "images", is_flag=True,
              help="Images: decoded images/s per core, ours vs a plain Pillow loop over the same files.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
@click.option("--storage", "store", type=click.Choice(["local", "s3"]), default="local", show_default=True,
              help="s3: the same shards read from S3 and from local disk, and their ratio.")
@click.option("--s3-url", help="With --storage s3: a bucket prefix the AWS chain reaches (s3://bucket/prefix); "
              "default: an S3 server (moto) started on loopback for the run.")
def bench_loader(rows, images, as_json, store, s3_url):
    """Loader samples/s: ours vs raw pyarrow (the limit), petastorm (own venv) and a naive Dataset."""
    if images:
        if store == "s3" or s3_url:
            raise click.UsageError("--images reads local shards; it does not go with --storage s3 or --s3-url")
        _bench_loader_images(rows or IMAGES_DEFAULT, as_json)
        return
    rows = rows or 1_000_000
    if store == "s3":
        _bench_loader_s3(rows, as_json, s3_url)
        return
    if s3_url:
        raise click.UsageError("--s3-url goes with --storage s3")

    result = _bench(run_loader, as_json, rows=rows)
    if result is None:
        return
    table = Table(title=f"loader, {result['train_rows']:,} train rows × {result['feature_width']} "
                        f"features, batch {result['batch_size']}, 1 process")
    for col in ("", "seconds", "samples/s", "ours ×"):
        table.add_column(col, justify="right")
    secs, sps, ratio = result["seconds"], result["samples_per_s"], result["ratio"]
    labels = {"ours": "ours (ShardLoader)", "raw_pyarrow": "raw pyarrow (limit, no shuffle)",
              "petastorm": "petastorm BatchedDataLoader",
              "naive": f"naive Dataset over pandas ({result['naive_batches']} batches)"}
    for k, text in labels.items():
        if k in secs:
            table.add_row(text, f"{secs[k]:.3f}", f"{sps[k]:,.0f}",
                          "" if k == "ours" else f"{ratio[f'vs_{k}']:.2f}")
    Console().print(table)
    if result["petastorm"]["status"] != "measured":
        console.print(f"  petastorm {result['petastorm']['status']}: {result['petastorm']['reason']}")
    t, met = result["targets"], result["met"]
    for k in ("vs_raw_pyarrow", "vs_petastorm"):
        if met[k] is not None:
            console.print(f"  ours {k.replace('_', ' ')} {ratio[k]:.2f} (target ≥ {t[k]}: "
                          f"{'met' if met[k] else 'NOT met'})")


def _bench_loader_images(n: int, as_json: bool) -> None:
    result = _bench(run_loader_images, as_json, n_images=n)
    if result is None:
        return
    c, h, w = result["image_shape"]
    fmts = " + ".join(f"{k} {v}" for k, v in result["formats"].items())
    table = Table(title=f"loader --images, {result['train_images']:,} images {c}×{h}×{w} ({fmts}), "
                        f"batch {result['batch_size']}, {result['cores']} cores, best of {result['repeats']}")
    table.add_column("", no_wrap=True)
    for col in ("seconds", "CPU s", "images/s", "per core", "ours ×"):
        table.add_column(col, justify="right")
    many = result["loader_threads"][1]
    ratio, per_core = result["ratio"], result["images_per_core_s"]
    rows = (("pillow", "Pillow, files", f"{ratio['vs_pillow']:.2f}"),
            ("pillow_in_memory", "Pillow, bytes in RAM", f"{ratio['vs_pillow_in_memory']:.2f}"),
            ("ours_1", "ours, 1 thread", ""), (f"ours_{many}", f"ours, {many} threads", ""))
    for k, text, r in rows:
        table.add_row(text, f"{result['seconds'][k]:.3f}", f"{result['cpu_seconds'][k]:.3f}",
                      f"{result['images_per_s'][k]:,.0f}", f"{per_core[k]:,.0f}", r)
    Console().print(table)
    t, met = result["targets"]["vs_pillow"], result["met"]["vs_pillow"]
    console.print(f"  ours per core vs Pillow per core: {ratio['vs_pillow']:.2f} (target ≥ {t}: "
                  f"{'met' if met else 'NOT met'}); with {many} threads {ratio[f'vs_pillow_{many}_threads']:.2f}")
    console.print(f"  {many} threads vs 1, images/s: {ratio['threads_scaling']:.2f}×. Per core: images per "
                  "CPU-second of the process, every thread counted; ours × : ours (1 thread) per core over it")
    b = result["bytes_per_image"]
    console.print(f"  bytes on disk per image: shards {b['shards']:,.0f}, raw files {b['raw']:,.0f} "
                  f"({result['bytes_ratio_shards_vs_raw']:.2f}×)")
    console.print(f"  petastorm: {result['petastorm']['status']} ({result['petastorm']['reason']})")


def _bench_loader_s3(rows: int, as_json: bool, s3_url: str | None) -> None:
    if s3_url:
        if not resolve(s3_url, "--s3-url").startswith("s3://"):
            raise click.UsageError("--s3-url takes an s3:// URL")
        check_access(s3_url, "--s3-url", write=True)
    try:
        result = _bench(run_loader_s3, as_json, rows=rows, s3_url=s3_url)
    except RuntimeError as e:  # no moto_server to start
        raise ShardlineError(f"bench loader --storage s3: {e}") from None
    if result is None:
        return
    table = Table(title=f"loader, {result['train_rows']:,} train rows in {result['train_shards']} shards "
                        f"({result['train_bytes'] / 1e6:.1f} MB), batch {result['batch_size']}, 1 process")
    for col in ("", "seconds", "samples/s", "× local"):
        table.add_column(col, justify="right")
    for k, text in (("local", "ShardLoader, local disk"), ("s3", f"ShardLoader, S3 ({result['s3']})")):
        ratio = f"{result['ratio_s3_vs_local']:.2f}" if k == "s3" else ""  # the S3 row, against local disk
        table.add_row(text, f"{result['seconds'][k]:.3f}", f"{result['samples_per_s'][k]:,.0f}", ratio)
    Console().print(table)


@bench.command("strategies")
@click.option("--steps", type=int, default=30, show_default=True, help="Timed steps per strategy (5 warm-up).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
def bench_strategies(steps, as_json):
    """Samples/s, peak memory per rank and pipeline bubble of every strategy on one transformer."""
    result = _bench(run_strategies, as_json, steps=steps)
    if result is not None:
        print_strategies(result)


@bench.command("sharding")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed steps per layout (after 1 warm-up step).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
def bench_sharding(steps, as_json):
    """Per-rank peak memory and step time of ddp, fsdp, tensor, dp_shard x tp and pp x tp at 4 ranks, one decoder."""
    from shardline.benchmarks.sharding import run as run_bench

    result = _bench(run_bench, as_json, steps=steps)
    if result is not None:
        print_sharding(result)


@bench.command("fsdp-limit")
@click.option("--budget-mb", type=click.IntRange(min=1), default=1200, show_default=True,
              help="Address space each rank may add once set up (RLIMIT_AS), before the model is built.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
def bench_fsdp_limit(budget_mb, as_json):
    """A 100M-weight model that ddp cannot train within a per-rank memory limit, trained by fsdp within it."""
    result = _bench(run_fsdp_limit, as_json, budget_mb=budget_mb)
    if result is not None:
        print_fsdp_limit(result, budget_mb)


@bench.command("scale")
@scale_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
def bench_scale(rows, data_dir, steps, engines, one_core, warm_up, as_json):
    """A large dataset on Spark and Dask: prepare, ddp steps, scoring; wall, rows/s, peak RSS of every
    process, disk written; growth over 1/100 of the rows; the forecast checked at 1 and 2 cores."""
    from shardline.benchmarks.scale import run as run_bench

    from .cli_bench_scale import print_scale

    result = _bench(run_bench, as_json, rows=rows, data_dir=data_dir, steps=steps,
                    engines=tuple(engines) or ("spark", "dask"), one_core=one_core, warm_up=warm_up)
    if result is not None:
        print_scale(result)


@bench.command("shapes")
@click.option("--files", type=click.IntRange(min=2), default=100_000, show_default=True,
              help="Small CSV files (against the same rows in 100 files).")
@click.option("--rows-per-file", type=click.IntRange(min=1), default=1_000, show_default=True)
@click.option("--skew-rows", type=click.IntRange(min=1000), default=10_000_000, show_default=True,
              help="Rows of the skewed input (one user in half the rows, one color in 90%).")
@click.option("--vector-rows", type=click.IntRange(min=1000), default=10_000_000, show_default=True,
              help="Rows of one wide vector column (skipped, said so, when the disk cannot hold them).")
@click.option("--width", type=click.IntRange(min=1), default=2048, show_default=True, help="Floats of the vector.")
@click.option("--data-dir", default="shardline-data/bench-scale", show_default=True,
              help="Where the raw data is generated once and kept for reruns.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
def bench_shapes(files, rows_per_file, skew_rows, vector_rows, width, data_dir, as_json):
    """Many small files, a skewed key and a dominant category, wide rows: each prepared on Spark
    and Dask (the same shards); listing time, driver memory, shard balance, a bad file refused."""
    from shardline.benchmarks.shapes import run as run_bench

    from .cli_bench_scale import print_shapes

    result = _bench(run_bench, as_json, files=files, rows_per_file=rows_per_file, skew_rows=skew_rows,
                    vector_rows=vector_rows, width=width, data_dir=data_dir)
    if result is not None:
        print_shapes(result)
