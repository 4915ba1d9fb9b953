"""A loop's figures to the job's one MLflow run, and the job's request to stop.

Each rank that logs opens its own client into the job's run (the driver opened it), through
the outage-bounded calls of training.mlflow_outage: while the server is unreachable the
calls are kept and training goes on, and what is left when the loop returns goes back to
the driver with the rank's result, which sends it (the restarts' and rank 0's calls
alike). A rank's own client, not a gather at the next collective: `ctx.log` is not
collective, so a loop may log on rank 0 only, or on one rank of several, at any time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import collectives
from ..tracking import MetricsReporter

if TYPE_CHECKING:
    from .context import LoopContext


def reporter(ctx: LoopContext) -> MetricsReporter:
    """This rank's handle on the job's run, made at its first use (no run: one that logs nothing)."""
    if ctx._reporter is None:
        ctx._reporter = MetricsReporter(ctx._job.tracking_uri, ctx._job.run_id, ctx._job.progress_addr)
    return ctx._reporter


def log_metrics(ctx: LoopContext, metrics: dict[str, float], step: int) -> None:
    """ctx.log: rank 0's names as given, another rank's as rank<r>_<name>."""
    figures = {name: float(value) for name, value in metrics.items()}
    if ctx.rank == 0:
        ctx.metrics.update(figures)
    else:
        figures = {f"rank{ctx.rank}_{name}": value for name, value in figures.items()}
    reporter(ctx).log(figures, step)


def pending(ctx: LoopContext) -> list[tuple]:
    """What this rank's client could not send (one last try first): the driver sends it."""
    return ctx._reporter.pending() if ctx._reporter is not None else []


def stop_requested(ctx: LoopContext, epoch: int | None, metrics: dict[str, float] | None) -> bool:
    """ctx.should_stop: rank 0 asks the job's epoch hook (a sweep's pruner), and every rank
    gets its answer, so all stop after the same epoch. A driver that was interrupted ends
    its ranks itself (launchers.guard): nothing to ask here."""
    hook = ctx._job.epoch_hook
    ask = ctx.rank == 0 and hook is not None and epoch is not None and bool(hook(epoch, dict(metrics or {})))
    flag = collectives.tensor([1.0 if ask else 0.0])
    collectives.broadcast(flag, src=0)
    stop = bool(flag.item())
    if stop:
        ctx.stopped_early = True
    return stop
