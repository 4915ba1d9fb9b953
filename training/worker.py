"""The one worker function every launcher calls, once per rank, inside the process group."""

from __future__ import annotations

import io
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from shardline.foundation import progress, storage
from shardline.foundation.code_travel import UserCode
from shardline.pipelines.manifest import ShardManifest, load_manifest

from .checkpoints import fingerprint
from . import collectives, task
from .checkpoints.store import CheckpointStore
from .batch import forward, split as split_batch, to_device
from .config import TrainingConfig
from .evaluate import evaluate
from .launchers.guard import stop_if_job_over
from .loader.reader import ShardLoader
from .models.builtin import apply_activation_checkpointing, build_model
from .strategies import Strategy, strategy_for
from .tracking import MetricsReporter


_SHOWN = ("train_loss", "train_accuracy", "train_rmse", "val_loss", "val_accuracy", "val_rmse", "val_r2",
          "val_perplexity", "samples_per_s")


@dataclass
class RankJob:
    """Everything a rank needs, made once by the driver's TrainingJob (training.job) and
    pickled to Spark tasks, Dask workers and processes; the same object for every attempt."""

    cfg: TrainingConfig
    dataset_dir: str
    # The job's strategy (its settings and mesh), resolved once on the driver; unset: resolved
    # from cfg when the job is made, so a rank never looks it up.
    strategy: Strategy | None = None
    # The dataset version (manifest number) the driver checked: ranks read it, not a newer one.
    dataset_sequence: int | None = None
    tracking_uri: str | None = None
    run_id: str | None = None
    fingerprint: dict | None = None
    resume_from: str | None = None  # a checkpoint URL; None starts from scratch
    # Rank 0 calls it after each epoch with (epoch, metrics); True stops every rank
    # after that epoch (a sweep's pruner). Must pickle, like the rest of the job.
    epoch_hook: Callable[[int, dict[str, float]], bool] | None = None
    # host:port of the driver's progress listener (foundation.progress); None prints here.
    progress_addr: str | None = None
    # The job's snapshot of the user's code (foundation.code_travel): what every rank imports.
    code: UserCode | None = None

    def __post_init__(self) -> None:
        if self.strategy is None:
            self.strategy = strategy_for(self.cfg)

    @property
    def socket_ifname(self) -> str | None:
        """What launchers.run_in_group exports as GLOO/NCCL_SOCKET_IFNAME before the group starts."""
        return self.cfg.socket_ifname

    @property
    def ranks_dir(self) -> str:
        """Where each rank says who it is (rank-N.json) and, failing with a bug, writes its
        traceback (rank-N.log: launchers.rank_errors); every host can write there."""
        return storage.join(self.cfg.checkpoint_dir, "ranks")


def train_rank(rank: int, world_size: int, job: RankJob) -> dict | None:
    """The rank function of a training job (see training.launchers)."""
    cfg = job.cfg
    torch.set_num_threads(cfg.threads_per_rank)
    device = collectives.device()  # chosen by run_in_group before the group (training.placement)
    manifest = load_manifest(job.dataset_dir, job.dataset_sequence)
    strategy = job.strategy
    # The Parallel keeps what this rank holds (a PS server, an fsdp rank: its shard only);
    # fsdp builds the model itself, sharded, from the builder (never whole on every rank).
    parallel = strategy.setup(
        strategy.model_for(partial(plain_model, manifest, cfg), device), cfg, rank, world_size, device,
        lambda params: make_optimizer(params, cfg),
    )
    reads = parallel.data_rank is not None
    # Regression with the default loss learns the standardised label (training.task).
    scale = task.label_scale(manifest, cfg.loss)
    loader_settings = dict(
        remainder=cfg.remainder, shuffle_buffer_rows=cfg.shuffle_buffer_rows,
        workers=cfg.loader_workers_for(manifest.plan), prefetch=cfg.prefetch_depth,
        verify=cfg.verify_shards, label_scale=scale,
    )
    # A rank that reads no data (a parameter server) keeps a loader too: it counts the
    # steps of an epoch and the position to resume from, the same on every rank.
    train = ShardLoader(
        manifest, job.dataset_dir, "train", parallel.data_rank if reads else 0, parallel.data_world,
        cfg.batch_size // parallel.data_world, cfg.seed, **loader_settings,
    )
    # Evaluation runs the plain model with the gathered weights on each data part's
    # share of the validation split, once: on the part's reporting rank. A sharded rank
    # that evaluates itself (fsdp: every rank reports) runs its sharded model instead.
    val_shards = manifest.splits["val"].shards if "val" in manifest.splits else []
    evaluated = len(val_shards) >= parallel.data_world  # the same on every rank
    val = (
        ShardLoader(
            manifest, job.dataset_dir, "val", parallel.data_rank, parallel.data_world,
            cfg.batch_size // parallel.data_world, cfg.seed, **loader_settings,
        )
        if evaluated and parallel.reports
        else None
    )
    sharded_eval = parallel.evaluates_sharded  # the same on every rank
    eval_model = build_model(manifest, cfg).to(device) if val is not None and not sharded_eval else None
    kind = task.task_of(manifest)
    # training.loss and training.metrics (the user's, if set), imported here in the rank.
    loss_fn, user_metrics = task.loss_for(cfg), task.user_metrics(cfg)

    optimizer = parallel.optimizer
    schedule = lr_factor(cfg, cfg.epochs * train.steps_per_epoch())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if optimizer else None
    reporter = MetricsReporter(job.tracking_uri, job.run_id) if rank == 0 else None
    store = CheckpointStore(cfg.checkpoint_dir)
    store.announce(rank)

    step = start_epoch = 0
    resumed_sums = None  # a mid-epoch checkpoint's running sums of its epoch (this rank's share)
    if job.resume_from:
        step, start_epoch, resumed_sums = _resume(job, store, parallel, scheduler, train, rank, world_size, device)
        # A setting the user allowed to change (--allow-changed lr) wins over the checkpoint's.
        fingerprint.apply_changed(optimizer, scheduler, cfg, cfg.resume_allow_changed)

    def checkpoint(epoch: int, step_in_epoch: int, artifact: bool, sums: torch.Tensor) -> None:
        # Every rank writes what it holds of the weights and the optimizer state, in
        # parallel, into the checkpoint's DCP directory (training.checkpoints.sharded); then
        # one small file, gathered to rank 0, says what each rank needs besides to resume
        # exactly (its schedule, RNG state, and mid-epoch its running sums of the epoch's
        # figures: a resumed epoch logs them over all its steps) and names the directory.
        # No weights in it.
        mine = {"scheduler": scheduler.state_dict() if scheduler else {}, "rng": rng_state(device),
                "sums": sums.cpu()}
        sharded = store.new_dcp_name(step)
        parallel.save_checkpoint(storage.join(store.url, sharded))
        ranks = collectives.gather_object(mine, dst=0)
        if rank != 0:
            return
        state = {
            "sharded": sharded,
            "ranks": ranks,
            "global_step": step,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "loader": train.state_dict(),
            "fingerprint": job.fingerprint or {},
            # The code's per-file digests: a resume over changed code names the files.
            "code_files": job.code.files if job.code else {},
            "run_id": job.run_id or "",
        }
        stop_if_job_over()  # an interrupted job commits no more checkpoints (launchers.guard)
        path = store.save(step, state, cfg.keep_checkpoints)  # and rotates, DCP directories too
        if reporter:
            reporter.checkpoint(path, step, artifact, storage.join(store.url, sharded))

    metrics: dict[str, float] = {}
    stopped_early = warned = False
    for epoch in range(start_epoch, cfg.epochs):
        seen = waited = stepping = 0.0
        steps_run = 0  # this epoch's steps in this process (a resumed epoch: the rest only)
        sums = task.zero_sums(kind)
        if resumed_sums is not None and epoch == start_epoch:  # the steps before the restart
            sums += resumed_sums.to(sums.device)
        start = time.perf_counter()
        # Resuming mid-epoch, the loader (its state loaded) yields exactly the rest.
        position = train.state_dict()
        step_in_epoch = position["batches"] if position["epoch"] == epoch else 0
        batches = (
            train.epoch(epoch) if reads
            else itertools.repeat((None, None), train.steps_per_epoch() - step_in_epoch)
        )
        while True:
            t = time.perf_counter()
            batch = next(batches, None)
            if batch is None:  # finding the epoch over is no step: not counted as waiting
                break
            waited += time.perf_counter() - t
            # Features or named tensors (training.batch); None on a rank that reads no data.
            x, y = split_batch(batch)
            x, y = to_device(x, device), to_device(y, device)
            out = parallel.step(x, y)
            if scheduler:
                scheduler.step()
            # A step's time: waiting for its batch plus computing on it (not logging or checkpoints).
            stepping += time.perf_counter() - t
            step += 1
            step_in_epoch += 1
            steps_run += 1
            seen += len(y) if y is not None else 0
            if out is not None:
                sums += task.batch_sums(kind, out[0], y, out[1])
            if step % cfg.log_every_steps == 0:
                # The reporting ranks' mean loss: rank 0 may hold none (a first pipeline stage).
                step_loss = _mean_over_reporting(out[1].item() if out is not None else None)
                if scale is not None:  # the MSE of the standardised label, in the label's units
                    step_loss *= scale[1] ** 2
                if reporter:
                    reporter.log({"train_loss_step": step_loss, "lr": cfg.lr * schedule(step)}, step)
            if cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0:
                checkpoint(epoch, step_in_epoch, artifact=False, sums=sums)
        elapsed = time.perf_counter() - start

        # Per-rank figures go to rank 0 through one all-reduce of a [world, k] table.
        per_rank = collectives.zeros(world_size, 6)
        per_rank[rank] = collectives.tensor([
            # Over the steps that ran only: an epoch of no steps waited for nothing.
            seen / elapsed, waited / stepping if stepping > 0 else 0.0,
            train.epoch_stats()["samples_per_s"] if reads else 0.0, float(parallel.reports),
            waited, float(steps_run),
        ])
        collectives.all_reduce(per_rank)
        collectives.all_reduce(sums)
        metrics = {
            **task.figures(kind, "train", sums, scale),
            # Ranks that split one model read the same samples: count each once.
            "samples_per_s": (per_rank[:, 0] * per_rank[:, 3]).sum().item(),
            "data_wait_fraction": per_rank[:, 1].max().item(),
        }
        for r in range(world_size):
            metrics[f"rank{r}_samples_per_s"] = per_rank[r, 0].item()
            metrics[f"rank{r}_data_wait_fraction"] = per_rank[r, 1].item()
            metrics[f"rank{r}_loader_samples_per_s"] = per_rank[r, 2].item()
        metrics.update(_strategy_metrics(parallel, rank, world_size))
        # The plain model's weights on every rank, for the plain evaluation model; a rank of
        # shards (fsdp) evaluates itself.
        full = parallel.full_state_dict() if evaluated and not sharded_eval else None
        if evaluated:
            if eval_model is not None:
                eval_model.load_state_dict(full)
                eval_model.eval()
            run = parallel.forward_eval if sharded_eval else partial(forward, eval_model)
            metrics.update(evaluate(run, val, device, kind, loss_fn, user_metrics, sharded_eval, scale))
        if reporter:
            reporter.log(metrics, epoch)
            shown = ", ".join(f"{k} {metrics[k]:.4g}" for k in _shown(metrics, strategy.name))
            progress.say(job.progress_addr, f"[shardline] epoch {epoch + 1}/{cfg.epochs}: {shown}")
            if not warned and data_wait_worth_warning(cfg, metrics["data_wait_fraction"],
                                                      per_rank[:, 4].max().item(), int(per_rank[:, 5].max().item())):
                # Once per job: later epochs' figures are in MLflow (rank*_data_wait_fraction).
                _warn_data_wait(job, epoch, cfg, per_rank[:, 1], loader_settings["workers"])
                warned = True
        checkpoint(epoch + 1, 0, artifact=True, sums=task.zero_sums(kind))
        if job.epoch_hook is not None and _stop_requested(job.epoch_hook, rank, epoch, metrics):
            # After the last epoch a stop changes nothing: the job simply completed.
            stopped_early = epoch + 1 < cfg.epochs
            break

    # Export: the plain model's weights, on rank 0 only, received there a tensor at a time
    # from the ranks that hold them (a rank of shards: gathered one tensor at a time).
    full = parallel.export_state_dict()
    if rank != 0:
        return None
    buf = io.BytesIO()
    torch.save({k: v.cpu() for k, v in full.items()}, buf)
    return {
        "state_dict": buf.getvalue(), "metrics": metrics, "stopped_early": stopped_early,
        "collective_calls": collectives.calls(),
        # The job's optimizer steps in all: the driver never registers a model that took none.
        "steps": step,
        # Tracking calls the MLflow server was down for: the driver sends them (mlflow_outage).
        "mlflow_pending": reporter.pending() if reporter else [],
    }


def _resume(job: RankJob, store: CheckpointStore, parallel, scheduler, train: ShardLoader, rank: int,
            world_size: int, device) -> tuple[int, int, torch.Tensor | None]:
    """Load the checkpoint into this rank; (global step, epoch, sums) to continue from.

    sums: mid-epoch, the epoch's running sums (task.batch_sums) before the checkpoint, every
    rank's added up on rank 0 (summed over the ranks at the epoch's end anyway); else None.

    Every rank reads the weights and optimizer state it holds now from the checkpoint's
    DCP directory, whichever ranks wrote them. At the mesh that wrote it every rank takes
    back its own schedule, RNG and the loader's position (the same on every rank). At
    another (the driver's check_resume allowed it: at an epoch end if the data-parallel
    ranks changed) RNG states stay freshly seeded (no model here draws any) and the next
    epoch starts from its beginning.
    """
    state = store.read(job.resume_from, fingerprint.comparable(job.fingerprint), job.cfg.resume_allow_changed)
    parallel.load_checkpoint(store.dcp_dir(job.resume_from, state))
    own = state["ranks"][rank] if len(state["ranks"]) == world_size else None
    # Every rank runs the same schedule; a rank with no optimizer saved none (a ps worker, a
    # pipeline stage without parameters), so one that now has one takes another rank's.
    schedule = own["scheduler"] if own and own["scheduler"] else next(
        (r["scheduler"] for r in state["ranks"] if r["scheduler"]), {})
    if scheduler and schedule:
        scheduler.load_state_dict(schedule)
    if own is not None:
        set_rng_state(own["rng"], device)
    sums = None
    if state["loader"]["world_size"] == parallel.data_world:
        train.load_state_dict(state["loader"])
        saved = [r["sums"] for r in state["ranks"] if r.get("sums") is not None]
        if rank == 0 and state["step_in_epoch"] and saved:  # older checkpoints have none
            sums = torch.stack(saved).sum(0)
    return state["global_step"], state["epoch"], sums


# The pieces of a step, shared with the bandwidth planner (training.plan) so that it
# measures the step training runs.


def plain_model(manifest: ShardManifest, cfg: TrainingConfig) -> torch.nn.Module:
    """The seeded plain model on the default device (a strategies.base.ModelBuilder: a
    mesh that splits the model calls it under torch.device("meta") too). The strategy
    applies activation checkpointing, in its order (strategies.parallelize)."""
    return build_model(manifest, cfg)


def trainable_model(manifest: ShardManifest, cfg: TrainingConfig, device: torch.device) -> torch.nn.Module:
    """The plain model on `device`, recomputing activations if configured: one process's
    model as the bandwidth planner measures it (training.plan)."""
    model = plain_model(manifest, cfg).to(device)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    return model


def make_optimizer(params, cfg: TrainingConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _shown(metrics: dict[str, float], strategy: str) -> list[str]:
    """The epoch line: the usual figures, then the strategy's own (job-wide means), which
    are named after it (Parallel.epoch_metrics)."""
    own = [k for k in metrics if k.startswith(f"{strategy}_")]
    return [k for k in _SHOWN if k in metrics] + own


def _mean_over_reporting(loss: float | None) -> float:
    t = collectives.tensor([loss or 0.0, 1.0 if loss is not None else 0.0])
    collectives.all_reduce(t)
    return (t[0] / t[1]).item()


def _strategy_metrics(parallel, rank: int, world_size: int) -> dict[str, float]:
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


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a step may draw from: the CPU's, and the rank's GPU's when it has one."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor] | torch.Tensor, device: torch.device) -> None:
    """Restore `rng_state(device)`. A GPU state is restored on a GPU rank only (a CPU
    resume of a GPU run draws nothing from it); a bare tensor is an older checkpoint's CPU state."""
    state = state if isinstance(state, dict) else {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def data_wait_worth_warning(cfg: TrainingConfig, fraction: float, waited_s: float, steps: int) -> bool:
    """An epoch's wait is worth a warning when it is a large share of the step time AND long
    in absolute terms over enough steps: a short run's start-up wait (the first batch while
    the loader warms up) is a large share of a few steps, yet nothing a user should tune."""
    return (fraction > cfg.data_wait_warning and waited_s >= cfg.data_wait_warning_min_s
            and steps >= cfg.data_wait_warning_min_steps)


def _warn_data_wait(job: RankJob, epoch: int, cfg: TrainingConfig, wait: torch.Tensor, workers: int) -> None:
    worst = int(wait.argmax())
    progress.say(
        job.progress_addr,
        f"[shardline] warning: epoch {epoch + 1}: rank {worst} waited for data "
        f"{wait[worst].item():.0%} of its step time (over {cfg.data_wait_warning:.0%}): raise "
        f"training.loader_workers (now {workers}) or training.prefetch_depth "
        f"(now {cfg.prefetch_depth}), or re-prepare with larger pipelines.layout.rows_per_row_group",
    )


def _stop_requested(hook, rank: int, epoch: int, metrics: dict[str, float]) -> bool:
    """Rank 0 asks the hook; every rank gets its answer, so all stop after the same epoch."""
    flag = collectives.tensor([1.0 if rank == 0 and hook(epoch, metrics) else 0.0])
    collectives.broadcast(flag, src=0)
    return bool(flag.item())


def lr_factor(cfg: TrainingConfig, total_steps: int):
    """The learning rate's factor after `step` steps: linear warmup from 0, then
    constant, cosine to 0, or x0.1 at each third of the run."""
    import math

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if cfg.lr_schedule == "step":
            return 0.1 ** min(int(progress * 3), 2)
        return 1.0

    return factor
