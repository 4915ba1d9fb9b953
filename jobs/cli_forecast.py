"""`shardline plan --hosts H --cores C`'s table: what was measured, the layout, each stage's forecast."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .console import console


def _s(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def print_forecast(r) -> None:
    f, m = r.forecast, r.measured
    cl = f.cluster
    where = f"{cl.hosts} host(s) × {cl.cores} core(s)" + (f" × {cl.gpus} GPU(s)" if cl.gpus else "")
    measured = Table(title=f"measured in {m.seconds:.1f} s on {m.prepare.rows:,} rows of the source, one core",
                     show_header=False, title_justify="left")
    i, pr, mr = m.input, m.prepare, m.model
    measured.add_row("input", f"{i.files:,} file(s), {i.rows:,} rows{' (estimated)' if i.rows_estimated else ''}, "
                     f"{i.tasks:,} task(s) a pass; listed in {i.list_s:.1f} s, described in {i.describe_s:.1f} s")
    per_core = {k: 1 / v if v else 0 for k, v in pr.s_per_row.items()}
    measured.add_row("prepare, rows/s per core", ", ".join(f"{k} {v:,.0f}" for k, v in per_core.items()))
    measured.add_row("training, samples/s per rank", f"{mr.train_samples_per_s:,.0f} (compute only), loader "
                     f"{mr.loader_samples_per_s:,.0f} per worker, evaluation {mr.forward_samples_per_s:,.0f}")
    measured.add_row("scoring, rows/s per core", f"{mr.score_rows_per_s:,.0f}")
    Console().print(measured)

    table = Table(title=f"forecast on {where}, {f.engine}, {f.rows:,} rows", title_justify="left")
    for col in ("stage", "wall", "driver MB", "per worker MB", "where the time goes"):
        table.add_column(col, justify="left" if col in ("stage", "where the time goes") else "right")
    stages = (("prepare", f.prepare), (f"{f.steps:,} steps", f.train_steps), ("an epoch", f.epoch),
              (f"score {f.splits['test']:,} test rows", f.score))
    for name, st in stages:
        parts = ", ".join(f"{k} {_s(v)}" for k, v in st.parts.items() if not k.endswith("_per_step"))
        table.add_row(name, _s(st.seconds), f"{st.driver_mb:,.0f}", f"{st.worker_mb:,.0f}", parts)
    table.add_row("prepare + epoch + score", _s(f.total_s), "", "", "")
    Console().print(table)

    lay = f.layout
    layout = Table(title="layout it would pick", show_header=False, title_justify="left")
    layout.add_row("prepare", f"{lay.prepare_tasks:,} task(s) a pass; shards "
                   + ", ".join(f"{k} {v}" for k, v in lay.shards.items()))
    layout.add_row("training", f"{lay.ranks} rank(s) × {lay.threads_per_rank} thread(s), local batch "
                   f"{lay.local_batch}, {lay.loader_workers_per_rank} loader worker(s) and {lay.shards_per_rank} "
                   f"shard(s) per rank, {lay.rows_per_row_group:,}-row groups")
    layout.add_row("scoring", f"{lay.score_tasks} task(s)")
    for k, v in lay.settings.items():
        layout.add_row(k, v)
    Console().print(layout)
    for note in f.notes:
        console.print(f"  {escape(note)}")
    if r.stored:
        console.print(f"  stored in {escape(r.stored)}: the next training run logs it to MLflow (forecast.json)")
