"""`shardline bench scale` and `bench shapes`: their options and tables."""

from __future__ import annotations

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardline.benchmarks.bench_engines import ENGINES

from .console import console

DATA_DIR = "shardline-data/bench-scale"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def print_scale(result: dict) -> None:
    table = Table(title=f"bench scale: {result['rows']:,} and {result['small_rows']:,} rows, "
                        f"{result['steps']:,} ddp steps, {result['machine']['cores']} cores")
    for col in ("engine", "cores", "rows", "stage", "wall s", "rows/s", "driver MB", "JVM MB", "ranks/workers MB",
                "disk written", "forecast s", "run/forecast"):
        table.add_column(col, justify="right")
    for leg in result["legs"]:
        role = ENGINES[leg["engine"]].rank_role
        for k in ("prepare", "train", "score"):
            s = leg["stages"][k]
            peaks = s["peak_rss_mb"]
            table.add_row(
                leg["engine"], str(leg["cores"]), f"{leg['rows']:,}", k, f"{s['seconds']:.1f}",
                f"{s['rows_per_s']:,.0f}", f"{max(peaks.get('driver', [0])):.0f}",
                f"{max(peaks['spark_jvm']):.0f}" if "spark_jvm" in leg["stages"][k].get("cpu_s_by_role", {})
                and leg["stages"][k]["cpu_s_by_role"]["spark_jvm"] > 0.1 else "",
                ", ".join(f"{x:.0f}" for x in peaks.get(role, [])[:4]), _gb(s["disk_written_bytes"]),
                f"{leg['forecast']['seconds'][k]:.1f}", f"{leg['forecast']['ratio_run_vs_forecast'][k]:.2f}",
            )
    Console().print(table)
    for leg in result["legs"]:
        t = leg["stages"]["train"]
        console.print(f"  {leg['engine']} {leg['cores']} core(s) {leg['rows']:,} rows: step {t['step_s'] * 1e3:.1f} ms, "
                      f"data-wait {t['data_wait']:.1%}, ranks added {', '.join(f'{x:.0f}' for x in t['rank_added_mb'])} "
                      f"MB, an epoch ({t['epoch_steps']:,} steps) forecast {leg['forecast']['epoch_s']:.0f} s")
    for engine, g in result["growth"].items():
        console.print(f"  {engine} growth ×{result['rows'] // max(1, result['small_rows'])} rows: " + ", ".join(
            f"{k} {g[k]['seconds']:.1f}× time" for k in ("prepare", "train", "score"))
            + f"; driver peak RSS {g['driver_peak_rss']:.2f}×, a rank's own memory {g['rank_added_rss']:.2f}×")
    for engine, checks in result["met"].items():
        console.print(f"  {engine}: " + ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, ok in checks.items()))
    for line in result["missed"]:
        console.print(f"  [red]missed[/]: {escape(line)}")


def scale_options(fn):
    fn = click.option("--rows", type=click.IntRange(min=20_000), default=300_000_000, show_default=True,
                      help="Rows of the big run (raw CSV of the quickstart's schema); the growth run has 1/100.")(fn)
    fn = click.option("--data-dir", default=DATA_DIR, show_default=True,
                      help="Where the raw data is generated once and kept for reruns (and the runs' work folder).")(fn)
    fn = click.option("--steps", type=click.IntRange(min=2), default=2000, show_default=True,
                      help="ddp steps on 2 ranks (the epoch is forecast).")(fn)
    fn = click.option("--engine", "engines", type=click.Choice(["spark", "dask"]), multiple=True,
                      help="Engines to run [default: both].")(fn)
    fn = click.option("--no-one-core", "one_core", is_flag=True, default=True, flag_value=False,
                      help="Skip the 1-core legs that check the forecast at 1 core.")(fn)
    fn = click.option("--no-warm-up", "warm_up", is_flag=True, default=True, flag_value=False,
                      help="Skip each engine's unreported warm-up job: the first leg's figures then include "
                           "the engine's first-job costs (imports, JIT).")(fn)
    return fn


def print_shapes(result: dict) -> None:
    f = result["files"]
    d, fd = f["driver"], f["few_files_driver"]
    console.print(f"many small files: {f['files']:,} × {f['rows_per_file']:,} rows; the driver listed them in "
                  f"{d['list_s']:.1f} s and described them in {d['describe_s']:.1f} s ({d['tasks']:,} tasks a pass; "
                  f"{fd['files']} files: {fd['list_s'] + fd['describe_s']:.2f} s)")
    table = Table(title="prepare: the same rows in many small files and in few")
    for col in ("engine", "files", "wall s", "driver peak MB", "× few files", "within 2×"):
        table.add_column(col, justify="right")
    for e, run in f["small"].items():
        few = f["few"][e]
        table.add_row(e, "100", f"{few['seconds']:.1f}",
                      f"{few['driver_peak_rss_mb']:.0f}", "", "")
        table.add_row(e, f"{f['files']:,}", f"{run['seconds']:.1f}", f"{run['driver_peak_rss_mb']:.0f}",
                      f"{f['ratio_small_vs_few'][e]:.2f}", "met" if f["met_within_2x"][e] else "NOT met")
    Console().print(table)
    console.print(f"  same shards on both engines: {f['same_shards']}")
    bad = f["bad_file"]
    for e in f["small"]:
        b = bad[e]
        console.print(f"  bad file {bad['file']} among {bad['files']:,} on {e}: "
                      f"{'named' if b['names_the_file'] else 'NOT named'}, "
                      f"{'nothing written' if b['nothing_written'] else 'SOMETHING WRITTEN'}: {escape(b['error'] or '')}")
    s = result["skew"]
    spread = ", ".join(f"{k} {v:.1%}" for k, v in s["spread"].items() if v is not None)
    console.print(f"skew ({s['rows']:,} rows): shard rows spread {spread} "
                  f"({'met' if s['met_spread'] else 'NOT met'}: ≤ 10%); same shards on both engines: {s['same_shards']}")
    v = result["vectors"]
    if "skipped" in v:
        console.print(f"wide rows ({v['rows']:,} × {v['width']} floats): skipped: {escape(v['skipped'])}")
    else:
        runs = "; ".join(f"{e} {r['seconds']:.1f} s, driver {r['driver_peak_rss_mb']:.0f} MB" for e, r in v["runs"].items())
        console.print(f"wide rows ({v['rows']:,} × {v['width']} floats, {_gb(v['raw_bytes'])} raw): {runs}; "
                      f"same shards: {v['same_shards']}")
