"""shardline's own training loop, written on the loop context: the model-factory path.

`train(ctx)` is what runs when `training.loop` is unset. It uses only what a user's loop
has (LoopContext): `ctx.parallel` for the job's strategy, `ctx.loader` for the shards,
`ctx.save` / `ctx.restore` for its checkpoints, `ctx.log` and `ctx.say` for MLflow and
the console, `ctx.should_stop` for a sweep's pruner and `ctx.register` for the model. Its
steps: setup (the strategy's Parallel, the loaders, the schedule; a restore), an epoch of
optimizer steps (with mid-epoch checkpoints), evaluation, the epoch's report, and the
epoch-end checkpoint.

Its checkpoint state is the Parallel's parts (`model`, `optimizer`: by the plain model's
names, so a checkpoint reshards), the `scheduler`, the train `loader` (its position) and
`sums`, this rank's running sums of the epoch's figures (a resumed epoch logs them over
all its steps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch

from .. import collectives, task
from ..batch import forward, split as split_batch
from ..checkpoints import fingerprint
from ..evaluate import evaluate
from ..loader.reader import ShardLoader
from ..strategies.base import Parallel
from .context import LoopContext
from .recipe import data_wait_worth_warning, lr_factor, make_optimizer

_SHOWN = ("train_loss", "train_accuracy", "train_rmse", "val_loss", "val_accuracy", "val_rmse", "val_r2",
          "val_perplexity", "samples_per_s")


@dataclass
class Run:
    """What the steps share: set up once per attempt."""

    parallel: Parallel
    train: ShardLoader
    val: ShardLoader | None
    evaluated: bool  # the validation split is evaluated (the same on every rank)
    eval_model: torch.nn.Module | None  # the plain model evaluation loads, where not sharded
    kind: str  # the dataset's task
    scale: tuple[float, float] | None  # the label's (mean, std) when it is learnt standardised
    scheduler: torch.optim.lr_scheduler.LambdaLR | None
    schedule: object  # step -> the learning rate's factor
    step: int = 0
    sums: torch.Tensor | None = None  # this rank's running sums of the epoch's figures
    warned: bool = False  # the data-wait warning is said once a job
    figures: dict = field(default_factory=dict)  # the epoch's timings (seconds, samples, steps)

    def state(self, restoring: bool = False) -> dict:
        """The checkpoint state (see the module docstring)."""
        state = {**self.parallel.checkpoint_parts(restoring), "loader": self.train,
                 "sums": self.sums.cpu().tolist() if self.sums is not None else []}
        if self.scheduler is not None:  # a rank with no optimizer (a ps worker) has none
            state["scheduler"] = self.scheduler
        return state


def train(ctx: LoopContext) -> None:
    """The built-in loop (see the module docstring)."""
    cfg = ctx.config
    run = setup(ctx)
    start_epoch, resumed_sums = restore(ctx, run)
    for epoch in range(start_epoch, cfg.epochs):
        run.sums = task.zero_sums(run.kind)
        if resumed_sums is not None and epoch == start_epoch:  # the steps before the restart
            run.sums += resumed_sums.to(run.sums.device)
        train_epoch(ctx, run, epoch)
        metrics = epoch_metrics(ctx, run)
        metrics.update(validate(ctx, run))
        report(ctx, run, epoch, metrics)
        run.sums = task.zero_sums(run.kind)
        ctx.save(run.state(), step=run.step, epoch=epoch + 1, artifact=True)
        if ctx.should_stop(epoch, metrics):
            # After the last epoch a stop changes nothing: the job simply completed.
            ctx.stopped_early = epoch + 1 < cfg.epochs
            break
    ctx.optimizer_steps = run.step
    # The plain model's weights, on rank 0 only, received there a tensor at a time from
    # the ranks that hold them (a rank of shards: gathered one tensor at a time).
    ctx.register(run.parallel)


def setup(ctx: LoopContext) -> Run:
    """The strategy's Parallel of the job's model, the loaders, the schedule."""
    cfg, manifest = ctx.config, ctx._manifest
    # The Parallel keeps what this rank holds (a PS server, an fsdp rank: its shard only);
    # fsdp builds the model itself, sharded, from the builder (never whole on every rank).
    parallel = ctx.parallel(ctx.build_model, partial(make_optimizer, cfg=cfg))
    # A rank that reads no data (a parameter server) keeps a loader too (ctx.loader).
    train_loader = ctx.loader("train")
    # Evaluation runs the plain model with the gathered weights on each data part's
    # share of the validation split, once: on the part's reporting rank. A sharded rank
    # that evaluates itself (fsdp: every rank reports) runs its sharded model instead.
    val_shards = manifest.splits["val"].shards if "val" in manifest.splits else []
    evaluated = len(val_shards) >= parallel.data_world  # the same on every rank
    val = ctx.loader("val") if evaluated and parallel.reports else None
    plain_eval = val is not None and not parallel.evaluates_sharded
    optimizer = parallel.optimizer
    schedule = lr_factor(cfg, cfg.epochs * train_loader.steps_per_epoch())
    return Run(
        parallel=parallel, train=train_loader, val=val, evaluated=evaluated,
        eval_model=ctx.build_model().to(ctx.device) if plain_eval else None,
        kind=task.task_of(manifest), scale=task.label_scale(manifest, cfg.loss),
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if optimizer else None,
        schedule=schedule,
    )


def restore(ctx: LoopContext, run: Run) -> tuple[int, torch.Tensor | None]:
    """The checkpoint the job continues from, if any: (the epoch to start, this rank's sums of
    that epoch's steps so far, None at an epoch's start). At another mesh the loader starts the
    next epoch (the driver allowed it at an epoch's end only) and RNG states stay freshly seeded."""
    state = run.state(restoring=True)
    step = ctx.restore(state)
    if step is None:
        return 0, None
    run.step = step
    # A setting the user allowed to change (--allow-changed lr) wins over the checkpoint's.
    fingerprint.apply_changed(run.parallel.optimizer, run.scheduler, ctx.config, ctx.config.resume_allow_changed)
    position = run.train.state_dict()
    mid_epoch = position["batches"] > 0 and state["sums"]
    return position["epoch"], torch.tensor(state["sums"], dtype=torch.float64) if mid_epoch else None


def train_epoch(ctx: LoopContext, run: Run, epoch: int) -> None:
    """The epoch's optimizer steps (the rest of it, resumed mid-epoch), with its mid-epoch
    checkpoints; its timings go to run.figures."""
    cfg, parallel, train_loader = ctx.config, run.parallel, run.train
    reads = parallel.data_rank is not None
    seen = waited = stepping = 0.0
    steps_run = 0  # this epoch's steps in this process (a resumed epoch: the rest only)
    start = time.perf_counter()
    # Resuming mid-epoch, the loader (its state loaded) yields exactly the rest.
    batches = train_loader.epoch(epoch) if reads else ((None, None) for _ in train_loader.count_epoch(epoch))
    while True:
        t = time.perf_counter()
        batch = next(batches, None)
        if batch is None:  # finding the epoch over is no step: not counted as waiting
            break
        waited += time.perf_counter() - t
        # Features or named tensors (training.batch); None on a rank that reads no data.
        x, y = split_batch(batch)
        out, sums = parallel.step_sums(ctx.to_device(x), ctx.to_device(y), partial(task.batch_sums, run.kind))
        if run.scheduler:
            run.scheduler.step()
        # A step's time: waiting for its batch plus computing on it (not logging or checkpoints).
        stepping += time.perf_counter() - t
        run.step += 1
        steps_run += 1
        seen += len(y) if y is not None else 0
        if sums is not None:
            run.sums += sums
        if run.step % cfg.log_every_steps == 0:
            log_step(ctx, run, out)
        if cfg.checkpoint_every_steps and run.step % cfg.checkpoint_every_steps == 0:
            ctx.save(run.state(), step=run.step, epoch=epoch)
    run.figures = {"elapsed": time.perf_counter() - start, "seen": seen, "waited": waited,
                   "stepping": stepping, "steps": steps_run}


def log_step(ctx: LoopContext, run: Run, out) -> None:
    """The reporting ranks' mean loss and the learning rate, to MLflow (rank 0)."""
    # The reporting ranks' mean loss: rank 0 may hold none (a first pipeline stage).
    loss = out[1].item() if out is not None else None
    t = collectives.tensor([loss or 0.0, 1.0 if loss is not None else 0.0])
    collectives.all_reduce(t)
    step_loss = (t[0] / t[1]).item()
    if run.scale is not None:  # the MSE of the standardised label, in the label's units
        step_loss *= run.scale[1] ** 2
    if ctx.rank == 0:
        ctx.log({"train_loss_step": step_loss, "lr": ctx.config.lr * run.schedule(run.step)}, run.step)


def epoch_metrics(ctx: LoopContext, run: Run) -> dict[str, float]:
    """The epoch's training figures: per-rank figures go to rank 0 through one all-reduce of a
    [world, k] table, the task's sums through another; the strategy's own, gathered."""
    f, parallel, world = run.figures, run.parallel, ctx.world_size
    reads = parallel.data_rank is not None
    per_rank = collectives.zeros(world, 6)
    per_rank[ctx.rank] = collectives.tensor([
        # Over the steps that ran only: an epoch of no steps waited for nothing.
        f["seen"] / f["elapsed"], f["waited"] / f["stepping"] if f["stepping"] > 0 else 0.0,
        run.train.epoch_stats()["samples_per_s"] if reads else 0.0, float(parallel.reports),
        f["waited"], float(f["steps"]),
    ])
    collectives.all_reduce(per_rank)
    collectives.all_reduce(run.sums)
    metrics = {
        **task.figures(run.kind, "train", run.sums, run.scale),
        # Ranks that split one model read the same samples: count each once.
        "samples_per_s": (per_rank[:, 0] * per_rank[:, 3]).sum().item(),
        "data_wait_fraction": per_rank[:, 1].max().item(),
    }
    for r in range(world):
        metrics[f"rank{r}_samples_per_s"] = per_rank[r, 0].item()
        metrics[f"rank{r}_data_wait_fraction"] = per_rank[r, 1].item()
        metrics[f"rank{r}_loader_samples_per_s"] = per_rank[r, 2].item()
    metrics.update(_strategy_metrics(parallel, ctx.rank))
    run.figures["per_rank"] = per_rank
    return metrics


def validate(ctx: LoopContext, run: Run) -> dict[str, float]:
    """The validation split's figures, when it is evaluated: the plain model with the weights
    gathered on every rank, or (a rank of shards: fsdp) the sharded model itself."""
    if not run.evaluated:
        return {}
    parallel, cfg = run.parallel, ctx.config
    sharded_eval = parallel.evaluates_sharded  # the same on every rank
    full = parallel.full_state_dict() if not sharded_eval else None  # collective
    if run.eval_model is not None:
        run.eval_model.load_state_dict(full)
        run.eval_model.eval()
    model_run = parallel.forward_eval if sharded_eval else partial(forward, run.eval_model)
    # training.loss and training.metrics (the user's, if set), imported here in the rank.
    return evaluate(model_run, run.val, ctx.device, run.kind, task.loss_for(cfg), task.user_metrics(cfg),
                    sharded_eval, run.scale)


def report(ctx: LoopContext, run: Run, epoch: int, metrics: dict[str, float]) -> None:
    """Rank 0: the epoch's figures to MLflow, its line to the console, and once a job the
    data-wait warning when loading held training back."""
    if ctx.rank != 0:
        return
    cfg = ctx.config
    ctx.log(metrics, step=epoch)
    shown = ", ".join(f"{k} {metrics[k]:.4g}" for k in _shown(metrics, ctx._strategy.name))
    ctx.say(f"[shardline] epoch {epoch + 1}/{cfg.epochs}: {shown}")
    per_rank = run.figures["per_rank"]
    if not run.warned and data_wait_worth_warning(cfg, metrics["data_wait_fraction"], per_rank[:, 4].max().item(),
                                                  int(per_rank[:, 5].max().item())):
        # Once per job: later epochs' figures are in MLflow (rank*_data_wait_fraction).
        wait = per_rank[:, 1]
        worst = int(wait.argmax())
        ctx.say(
            f"[shardline] warning: epoch {epoch + 1}: rank {worst} waited for data "
            f"{wait[worst].item():.0%} of its step time (over {cfg.data_wait_warning:.0%}): raise "
            f"training.loader_workers (now {run.train.workers}) or training.prefetch_depth "
            f"(now {cfg.prefetch_depth}), or re-prepare with larger pipelines.layout.rows_per_row_group",
        )
        run.warned = True


def _shown(metrics: dict[str, float], strategy: str) -> list[str]:
    """The epoch line: the usual figures, then the strategy's own (job-wide means), which
    are named after it (Parallel.epoch_metrics)."""
    own = [k for k in metrics if k.startswith(f"{strategy}_")]
    return [k for k in _SHOWN if k in metrics] + own


def _strategy_metrics(parallel: Parallel, rank: int) -> dict[str, float]:
    """Each rank's strategy figures (rank<r>_<name>) and their mean over the ranks that have them."""
    gathered = collectives.gather_object(parallel.epoch_metrics(), dst=0)
    if rank != 0:
        return {}
    out, by_name = {}, {}
    for r, figures in enumerate(gathered):
        for k, v in figures.items():
            out[f"rank{r}_{k}"] = v
            by_name.setdefault(k, []).append(v)
    for k, values in by_name.items():
        out[k] = max(values) if k.endswith("_max") else sum(values) / len(values)
    return out
