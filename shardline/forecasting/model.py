"""The forecast itself: measured per-core figures (measure.Measured) and an engine's costs
(costs) turned into wall time and memory for H hosts x C cores. Pure: the same figures,
the same forecast; tested on chosen figures, never on a machine's speed.

A data phase's rows are shared by the tasks that run at once (the cores, or fewer when
there are fewer tasks) at the engine's efficiency; every task adds its fixed cost, in
waves of `slots`. Training is steps x the slowest of a rank's compute and the CPU it
shares with its loader, plus the all-reduce of its gradients; an epoch adds evaluation.
"""

from __future__ import annotations

import math

from pydantic import BaseModel

from . import costs
from .measure import Measured


class Cluster(BaseModel):
    hosts: int
    cores: int  # per host
    gpus: int = 0  # per host

    @property
    def slots(self) -> int:
        return self.hosts * self.cores


class Stage(BaseModel):
    seconds: float
    parts: dict[str, float]  # where the seconds go
    cpu_s: float  # CPU seconds of the work on every core (what a busy machine does not stretch)
    driver_mb: float
    worker_mb: float  # per executor core / Dask worker / rank


class Layout(BaseModel):
    """What the forecast assumes, and would set."""

    prepare_tasks: int
    shards: dict[str, int]
    ranks: int
    local_batch: int
    threads_per_rank: int
    loader_workers_per_rank: int
    shards_per_rank: int
    rows_per_row_group: int
    score_tasks: int
    settings: dict[str, str]  # engine settings to set on the cluster


class Forecast(BaseModel):
    engine: str
    cluster: Cluster
    rows: int
    splits: dict[str, int]
    prepare: Stage
    steps: int  # the steps `train_steps` is for
    train_steps: Stage
    epoch: Stage
    score: Stage
    layout: Layout
    notes: list[str]

    @property
    def total_s(self) -> float:
        """prepare + one epoch + scoring the test split."""
        return self.prepare.seconds + self.epoch.seconds + self.score.seconds


def forecast(m: Measured, cfg, cluster: Cluster, engine: str, steps: int = 2000) -> Forecast:
    """cfg: the ShardlineConfig (splits, layout, training and serving settings)."""
    c = costs.ENGINES[engine]
    p = cfg.pipelines
    rows = m.input.rows
    fractions = {"train": p.split.train, "val": p.split.val, "test": p.split.test}
    splits = {s: round(rows * f) for s, f in fractions.items()}
    shards = {s: _shard_count(n, m.model.row_bytes, p.layout.world_size, p.layout.target_shard_bytes)
              for s, n in splits.items()}
    prep = _prepare(m, c, cluster, rows, sum(shards.values()), max(1, max(
        (n // max(1, shards[s]) for s, n in splits.items()), default=1)))
    layout_ranks, threads = _ranks(cfg.training, cluster)
    train, plan, step_s = _train(m, c, cfg.training, cluster, layout_ranks, splits, steps)
    epoch = _epoch(m, c, cfg.training, layout_ranks, splits, step_s, train.worker_mb)
    score = _score(m, c, cluster, splits["test"], shards["test"])
    notes = []
    if cluster.gpus and m.model.device == "cpu":
        notes.append("no GPU here: training was measured on the CPU; a GPU's steps will be faster")
    if m.input.rows_estimated:
        notes.append("rows estimated from the input's bytes and the sample's bytes per row")
    layout = Layout(
        prepare_tasks=m.input.tasks, shards=shards, ranks=layout_ranks, local_batch=cfg.training.batch_size // layout_ranks,
        threads_per_rank=threads, loader_workers_per_rank=plan.loader_workers_per_rank,
        shards_per_rank=plan.shards_per_rank, rows_per_row_group=plan.rows_per_row_group,
        score_tasks=shards["test"], settings=_settings(engine, cluster, prep, score, train),
    )
    return Forecast(engine=engine, cluster=cluster, rows=rows, splits=splits, prepare=prep, steps=steps,
                    train_steps=train, epoch=epoch, score=score, layout=layout, notes=notes)


def _shard_count(rows: int, row_bytes: float, world: int, target: int) -> int:
    """pipelines.shard_counts' size rule: shards of about `target` bytes, a multiple of `world`."""
    if rows == 0:
        return 0
    wanted = max(1, math.ceil(rows * row_bytes / target))
    return world * math.ceil(wanted / world)


def _waves(tasks: int, slots: int) -> int:
    return math.ceil(tasks / max(1, slots))


def _prepare(m: Measured, c: costs.EngineCosts, cl: Cluster, rows: int, shards: int, shard_rows: int) -> Stage:
    r = m.prepare.s_per_row
    tasks, shards = max(1, m.input.tasks), max(1, shards)

    def phase(seconds_per_row: float, n: int) -> float:
        """n equal tasks in waves of the slots, each its rows at the engine's efficiency, each
        with its fixed cost: 3 tasks on 2 cores take two tasks' time, not one and a half."""
        return _waves(n, cl.slots) * (rows / n * seconds_per_row / c.efficiency + c.task_s)

    parts = {  # each pass is one engine job
        "driver": m.input.list_s + m.input.describe_s,
        "pass1": c.job_s + phase(r["pass1"], tasks),
        "pass2": c.shuffle_job_s + phase(r["pass2"] + c.shuffle_x * r["shuffle"], tasks),
        "write": phase(r["write"], shards),
    }
    cpu = rows * (r["pass1"] + r["pass2"] + c.shuffle_x * r["shuffle"] + r["write"]) / c.efficiency
    mb = m.prepare.mb_per_row
    in_flight = min(max(1, m.input.largest_unit_rows), 1 << 20)  # a pass-1 batch: at most UNIT_ROWS
    worker = costs.WORKER_BASE_MB + max(mb["pass1"] * in_flight, mb["write"] * shard_rows)
    driver = m.prepare.driver_mb + costs.DRIVER_MB_PER_FILE * m.input.files + costs.DRIVER_MB_PER_SHARD * shards
    return Stage(seconds=sum(parts.values()), parts=parts, cpu_s=cpu, driver_mb=driver, worker_mb=worker)


def _ranks(t, cl: Cluster) -> tuple[int, int]:
    """Ranks and threads per rank: a rank per GPU, else a rank per threads_per_rank cores."""
    if cl.gpus:
        return cl.hosts * cl.gpus, t.threads_per_rank
    return max(1, cl.slots // t.threads_per_rank), t.threads_per_rank


def _step_s(m: Measured, t, cl: Cluster, ranks: int, workers: int) -> tuple[float, dict[str, float]]:
    """One step's seconds: a local batch's compute, or the CPU it shares with its loader
    when the rank's cores are fewer than its threads, plus the gradients' all-reduce."""
    b = t.batch_size // ranks
    compute = b / m.model.train_samples_per_s * (costs.DDP_STEP_X if ranks > 1 else 1.0)
    load = b / m.model.loader_samples_per_s
    cores = cl.slots / ranks
    # The loader's workers overlap the step; on a CPU they share the rank's cores with it.
    shared = load / max(1.0, min(workers, cores))
    if not cl.gpus:
        shared = max(shared, (compute * t.threads_per_rank + load) / cores)
    bw = costs.LOOPBACK_BYTES_PER_S if cl.hosts == 1 else costs.NETWORK_BYTES_PER_S
    allreduce = (2 * (ranks - 1) / ranks * m.model.parameters * 4 / bw + costs.ALLREDUCE_LATENCY_S) if ranks > 1 else 0.0
    return max(compute, shared) + allreduce, {"compute": compute, "loader_cpu": load, "allreduce": allreduce}


def _train(m: Measured, c: costs.EngineCosts, t, cl: Cluster, ranks: int, splits: dict[str, int], steps: int):
    """`steps` steps on `ranks` ranks, with the loader workers, shards and row groups the
    bandwidth planner picks for the measured rates (training.plan.choose_layout)."""
    from shardline.training.plan import choose_layout

    plan = choose_layout(
        m.model.train_samples_per_s, m.model.loader_samples_per_s, world_size=ranks,
        local_batch=t.batch_size // ranks, train_rows=splits["train"],
        max_workers_per_rank=max(1, cl.slots // ranks),  # as training.plan caps them: a rank's cores
    )
    step, parts = _step_s(m, t, cl, ranks, plan.loader_workers_per_rank)
    seconds = c.rank_start_s + steps * step
    rank_mb = (costs.TORCH_BASE_MB + m.model.parameters * costs.TRAIN_BYTES_PER_WEIGHT / 1e6
               + m.model.row_bytes * (t.shuffle_buffer_rows * 2
                                      + plan.loader_workers_per_rank * t.prefetch_depth * plan.rows_per_row_group) / 1e6)
    cpu = steps * ranks * (parts["compute"] * t.threads_per_rank + parts["loader_cpu"])
    stage = Stage(seconds=seconds, parts={"start": c.rank_start_s, "steps": steps * step, **{
        f"{k}_per_step": v for k, v in parts.items()}}, cpu_s=cpu, driver_mb=m.prepare.driver_mb, worker_mb=rank_mb)
    return stage, plan, step


def _epoch(m: Measured, c: costs.EngineCosts, t, ranks: int, splits: dict[str, int], step_s: float,
           rank_mb: float) -> Stage:
    """One pass over the train split (each rank its share, in local batches) and the
    evaluation of the val split after it."""
    steps = splits["train"] // ranks // max(1, t.batch_size // ranks)
    parts = {"start": c.rank_start_s, "steps": steps * step_s,
             "evaluate": splits["val"] / (ranks * m.model.forward_samples_per_s)}
    cpu = splits["train"] * (t.threads_per_rank / m.model.train_samples_per_s + 1 / m.model.loader_samples_per_s) \
        + splits["val"] / m.model.forward_samples_per_s
    return Stage(seconds=sum(parts.values()), parts=parts, cpu_s=cpu, driver_mb=m.prepare.driver_mb,
                 worker_mb=rank_mb)


def _score(m: Measured, c: costs.EngineCosts, cl: Cluster, rows: int, shards: int) -> Stage:
    tasks = max(1, shards)
    parts = {
        "start": c.score_start_s,
        "score": rows / (min(cl.slots, tasks) * c.efficiency * m.model.score_rows_per_s) + _waves(tasks, cl.slots) * c.task_s,
    }
    worker = costs.TORCH_BASE_MB + m.model.parameters * 4 / 1e6 \
        + 4096 * (m.model.row_bytes + m.model.score_bytes_per_row) * 4 / 1e6
    cpu = rows / (c.efficiency * m.model.score_rows_per_s)
    return Stage(seconds=sum(parts.values()), parts=parts, cpu_s=cpu, driver_mb=m.prepare.driver_mb, worker_mb=worker)


def _settings(engine: str, cl: Cluster, prep: Stage, score: Stage, train: Stage) -> dict[str, str]:
    """Memory to give each engine process: the largest forecast for one core's work, x1.5
    headroom, rounded up to 256 MB; in the engine's own settings (costs.SETTINGS)."""
    per_core = max(prep.worker_mb, score.worker_mb, train.worker_mb) * 1.5
    return costs.SETTINGS[engine](cl.hosts, cl.cores, per_core)
