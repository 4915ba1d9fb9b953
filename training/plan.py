"""The bandwidth planner (`shardline plan`): measure, then choose a layout that feeds the model.

Two measurements, each bounded to about a second:
- training samples/s per rank (`measure_training`): the configured model on
  synthetic batches of the dataset's shape, on the device training would use;
- loader samples/s of one loader worker (`measure_loader`): rank 0's real train shards,
  whole epochs from their start, decoding included; refused (one line) when an epoch
  has too few batches to time.

Then a pure rule (`choose_layout`) turns the two figures into loader workers per
rank, train shards per rank and rows per row group, so that loading bandwidth is
at least HEADROOM x training bandwidth, and predicts the data-wait fraction.
`pipelines.prepare(..., by_plan=True)` lays shards out by the plan and training
takes its loader workers (TrainingConfig.loader_workers_for).
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import os
import time

import torch

from shardline.foundation import storage
from shardline.foundation.errors import DataError
from shardline.pipelines.manifest import BandwidthPlan, ShardManifest
from shardline.pipelines.transform import continuous_width

from .batch import pin, rows as batch_rows, split, to_device
from .config import TrainingConfig
from .job import preflight
from .launchers import available_cores
from .loader.reader import ShardLoader
from .models.inputs import ModelInputs
from .strategies import Strategy, strategy_for
from .strategies.base import train_step
from .strategies.precision import Precision
from .task import loss_for
from .loop.recipe import make_optimizer, trainable_model

HEADROOM = 1.2  # loading >= 1.2 x training: measurement noise and imperfect worker scaling
# Hash assignment keeps a split's shards within 5% of each other's rows from about
# this many rows per shard (measured over 2-16 shards), so shards are never smaller.
MIN_SHARD_ROWS = 10_000
ROW_GROUP_BATCHES = 16  # local batches per row group
ROW_GROUP_ROUND = 1024
# Below ~16k rows a row group's fixed cost shows: on the quickstart shards 4,096-row
# groups load ~25% slower than 16,384, while 16,384 and 65,536 load alike.
MIN_ROW_GROUP, MAX_ROW_GROUP = 16_384, 65_536
# Images: local batches per row group. A worker decodes a row group whole before any of its
# rows can leave, so its decode time is the first batch's wait and the unit the workers
# share; decoding dwarfs a row group's fixed cost, so no 16,384-row floor (that many
# 64 x 64 PNGs take ~5 s to decode on one core).
DECODED_ROW_GROUP_BATCHES = 4
# measure_loader: fewer batches than this in rank 0's epoch and the epoch's start (threads,
# the shuffle buffer's first rows) is most of what is timed; at least MEASURED_BATCHES are
# timed in all, over as many epochs as that takes.
MIN_LOADER_BATCHES, MEASURED_BATCHES = 8, 16


def choose_layout(
    train_samples_per_s: float,
    loader_samples_per_s_per_worker: float,
    *,
    world_size: int,
    local_batch: int,
    train_rows: int,
    max_workers_per_rank: int,
    min_shards_per_rank: int = 1,
    headroom: float = HEADROOM,
    decoded: bool = False,
) -> BandwidthPlan:
    """The layout for the measured figures (per rank). Pure: same numbers, same plan.

    - loader workers per rank: the fewest n with n x per-worker >= headroom x training,
      at most `max_workers_per_rank` (the cores of a rank); when the cap cannot meet
      the target, `target_met` is False and `required_loader_workers` says what it needed.
      Assumes loading grows linearly with workers; the headroom absorbs part of the shortfall.
    - rows per row group: ROW_GROUP_BATCHES local batches within 16,384..65,536
      (`decoded`, image columns: DECODED_ROW_GROUP_BATCHES, no floor), at most a rank's
      rows / workers; `_row_group_rows` says why.
    - shards per rank: at least the workers, so each worker can stream its own file, and
      at least `min_shards_per_rank` (the dataset's size rule, pipelines.layout.target_shard_bytes);
      at most a rank's rows / MIN_SHARD_ROWS (hash balance), and at least 1.
    - predicted data-wait: with prefetch, loading overlaps compute, so a step takes
      max(b/training, b/loading) for a local batch b; the wait is the difference, as a
      share of the step: max(0, 1 - loading/training).
    """
    if train_samples_per_s <= 0 or loader_samples_per_s_per_worker <= 0:
        raise DataError("the planner measured no throughput (0 samples/s); nothing to plan from")
    cap = max(1, max_workers_per_rank)
    needed = headroom * train_samples_per_s
    required = max(1, math.ceil(needed / loader_samples_per_s_per_worker))
    workers = min(required, cap)
    loading = workers * loader_samples_per_s_per_worker

    rows_per_rank = max(1, train_rows // world_size)
    group = _row_group_rows(local_batch, rows_per_rank, workers, decoded)

    shards = max(workers, min_shards_per_rank)
    shards = max(1, min(shards, rows_per_rank // MIN_SHARD_ROWS))

    return BandwidthPlan(
        train_samples_per_s=train_samples_per_s,
        loader_samples_per_s_per_worker=loader_samples_per_s_per_worker,
        loader_workers_per_rank=workers,
        shards_per_rank=shards,
        rows_per_row_group=group,
        world_size=world_size,
        local_batch=local_batch,
        headroom=headroom,
        required_loader_workers=required,
        max_loader_workers_per_rank=cap,
        loading_samples_per_s=loading,
        target_met=loading >= needed,
        predicted_data_wait=max(0.0, 1.0 - loading / train_samples_per_s),
    )


def _row_group_rows(local_batch: int, rows_per_rank: int, workers: int, decoded: bool) -> int:
    """Rows per row group: ROW_GROUP_BATCHES local batches, rounded up to 1,024 and
    clamped to 16,384..65,536: from 16,384 rows a row group's fixed cost (Parquet
    headers, a loader round-trip) no longer shows, up to 65,536 the row groups in
    flight per worker stay small and the default 65,536-row shuffle buffer still mixes
    several; then at most a rank's rows / workers, so every worker has one to decode.
    The per-worker figure was measured on the current row groups: re-run the planner
    after `prepare --plan` to confirm the plan on the new layout. `decoded` (image
    columns): DECODED_ROW_GROUP_BATCHES local batches, no 16,384-row floor."""
    if decoded:
        group = DECODED_ROW_GROUP_BATCHES * local_batch
    else:
        group = ROW_GROUP_ROUND * math.ceil(ROW_GROUP_BATCHES * local_batch / ROW_GROUP_ROUND)
        group = min(max(group, MIN_ROW_GROUP), MAX_ROW_GROUP)
    return max(1, min(group, rows_per_rank // workers))


def plan_dataset(
    cfg: TrainingConfig,
    dataset_dir: str | os.PathLike,
    *,
    cores: int | None = None,
    budget_s: float = 1.0,
    manifest: ShardManifest | None = None,
) -> tuple[ShardManifest, BandwidthPlan]:
    """Measure on the dataset and choose its layout; the manifest measured comes back
    too, so the caller stores the plan only into that version (pipelines.manifest.store_plan).
    manifest: the version the caller checked already (training.job.preflight); else checked here."""
    dataset_dir = storage.resolve(str(dataset_dir), "pipelines.dataset_dir")
    if manifest is None:
        manifest = preflight(cfg, dataset_dir)  # the errors training itself would raise
    device = training_device()
    strategy = strategy_for(cfg)  # once: the measurements and the plan split batches as it does
    # The loader first: a dataset too small to time it is refused before the model is measured.
    loader = measure_loader(manifest, dataset_dir, cfg, budget_s=budget_s, strategy=strategy)
    train = measure_training(manifest, cfg, device, budget_s=budget_s, strategy=strategy)
    return manifest, plan_from_measurements(manifest, cfg, train, loader, cores=cores, device=device,
                                            strategy=strategy)


def plan_from_measurements(
    manifest: ShardManifest,
    cfg: TrainingConfig,
    train_samples_per_s: float,
    loader_samples_per_s_per_worker: float,
    *,
    cores: int | None = None,
    device: torch.device | None = None,
    strategy: Strategy | None = None,
) -> BandwidthPlan:
    """The plan for two measured figures on this dataset and config: what `plan_dataset`
    does after measuring. Split out so the rule is tested on chosen figures, never on
    a machine's speed. strategy: the job's (strategy_for(cfg)); None resolves it here."""
    # The plan is per data part: the ranks that read one share of each batch (all of them
    # for ddp; ps workers; the dp replicas of a split model, whose ranks read alike).
    parts = (strategy or strategy_for(cfg)).data_world
    train_split = manifest.split("train")
    by_size = math.ceil(
        sum(s.bytes for s in train_split.shards) / manifest.layout.target_shard_bytes / parts
    )
    plan = choose_layout(
        train_samples_per_s, loader_samples_per_s_per_worker,
        world_size=parts,
        local_batch=cfg.batch_size // parts,
        train_rows=train_split.rows,
        # A rank's loader threads share its cores with its training threads; more
        # threads than cores only contend, so the cores per rank cap the workers.
        max_workers_per_rank=(cores or available_cores()) // cfg.world_size,
        min_shards_per_rank=by_size,
        decoded=bool(manifest.feature_spec.images),
    )
    ckpt = " activation-checkpointed" if cfg.activation_checkpointing else ""
    what = f"{cfg.model} {cfg.hidden} {cfg.strategy} {cfg.precision}{ckpt}, {cfg.threads_per_rank} thread(s)/rank"
    return plan.model_copy(update={
        "device": str(device or training_device()), "model": what,
        "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    })


def measure_training(
    manifest: ShardManifest, cfg: TrainingConfig, device: torch.device, *, budget_s: float = 1.0,
    strategy: Strategy | None = None,
) -> float:
    """Per-rank training samples/s: the model's steps on synthetic local batches.

    This is the compute bandwidth, an upper bound on a rank's training throughput:
    one process, no all-reduce (the strategy's communication is left out, it needs a
    process group). A faster figure asks for more loading, so the plan errs towards
    more loader capacity. Steps are the strategies' train_step, with its
    host-to-device copy and loss.item() around it; 2 warm-up steps, then at least 2
    timed steps and until `budget_s` has passed.
    """
    local_batch = cfg.batch_size // (strategy or strategy_for(cfg)).data_world
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads_per_rank)  # as a rank runs; restored below
    try:
        model = trainable_model(manifest, cfg, device)
        model.train()
        optimizer = make_optimizer(model.parameters(), cfg)
        autocast = Precision.of(cfg).autocast(device)
        loss_fn = loss_for(cfg)
        # A few distinct batches, cycled: realistic inputs without generating one per step.
        batches = [_synthetic_batch(manifest, local_batch, seed) for seed in range(4)]
        if device.type == "cuda":
            batches = [(pin(x), y.pin_memory()) for x, y in batches]

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            x, y = to_device(x, device), y.to(device, non_blocking=True)
            _, loss = train_step(model, optimizer, autocast, x, y, loss_fn)
            loss.item()  # the worker reads the loss every step, which also syncs a GPU

        for i in range(2):
            step(i)
        steps, start = 0, time.perf_counter()
        while steps < 2 or time.perf_counter() - start < budget_s:
            step(steps)
            steps += 1
        return steps * local_batch / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def measured_loader(manifest: ShardManifest, dataset_dir: str, cfg: TrainingConfig,
                    strategy: Strategy | None = None) -> ShardLoader:
    """The loader `measure_loader` times: one worker over rank 0's train shards. Raises the
    one-line DataError when its epoch is too short to time (the CLI asks before it starts
    measuring, so the refusal is the only line)."""
    parts = (strategy or strategy_for(cfg)).data_world
    local_batch = cfg.batch_size // parts
    loader = ShardLoader(
        manifest, dataset_dir, "train", 0, parts, local_batch, cfg.seed,
        remainder=cfg.remainder, shuffle_buffer_rows=cfg.shuffle_buffer_rows,
        workers=1, prefetch=cfg.prefetch_depth,
    )
    steps = loader.steps_per_epoch()
    if steps == 0:
        raise DataError(
            f"{dataset_dir}: rank 0 of {parts} has fewer train rows than one local "
            f"batch ({local_batch}); nothing to measure"
        )
    if steps < MIN_LOADER_BATCHES:
        raise DataError(
            f"{dataset_dir}: the loader's rate cannot be measured: rank 0 of {parts} reads "
            f"{loader.rows} train rows in {loader.row_groups} row group(s), {steps} batch(es) of "
            f"{local_batch} an epoch (at least {MIN_LOADER_BATCHES} are needed); prepare more rows, "
            "or lower training.batch_size"
        )
    return loader


def measure_loader(
    manifest: ShardManifest, dataset_dir: str, cfg: TrainingConfig, *, budget_s: float = 1.0,
    strategy: Strategy | None = None,
) -> float:
    """Samples/s one loader worker delivers from rank 0's real train shards, drained
    as fast as they come (no training), with training's shuffle buffer and prefetch.

    Whole epochs, each from its start: reading, decoding (images) and the shuffle buffer's
    first rows are paid as in training. An epoch longer than the budget is cut, still
    counted from its start (the rows the buffer holds then are left out: the figure errs
    low). At least MEASURED_BATCHES batches are timed. An epoch of fewer than
    MIN_LOADER_BATCHES batches is refused: its start would be most of what is timed.
    """
    loader = measured_loader(manifest, dataset_dir, cfg, strategy)
    samples, seconds, batches = 0, 0.0, 0
    start = time.perf_counter()
    for epoch in itertools.count():
        epoch_start, cut = time.perf_counter(), False
        it = loader.epoch(epoch)
        for batch in it:
            samples += batch_rows(split(batch)[0])
            batches += 1
            if time.perf_counter() - start >= budget_s and batches >= MEASURED_BATCHES:
                cut = True
                break
        it.close()  # a cut epoch: its threads stop now
        seconds += time.perf_counter() - epoch_start
        if cut or (time.perf_counter() - start >= budget_s and batches >= MEASURED_BATCHES):
            break
    return samples / seconds


def training_device() -> torch.device:
    """The device a rank trains on (training.loop.runner): a GPU when there is one."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _synthetic_batch(manifest: ShardManifest, rows: int, seed: int):
    """Random rows of the dataset's shape: standard-normal continuous features, valid
    category indices (0 is unknown) and labels; values never change a step's cost. A
    dataset with tensor or image columns: the named tensors' zeros (ModelInputs.sample_batch)."""
    g = torch.Generator().manual_seed(seed)
    spec, stats = manifest.feature_spec, manifest.statistics
    if spec.typed:
        # The target as the loader yields it: next_token's is the token ids [rows, length].
        x, y = ModelInputs.from_manifest(manifest).sample_batch(rows)
        if y.dim() == 1 and not y.is_floating_point():
            y = torch.randint(0, max(1, stats.num_classes), (rows,), generator=g)
        return x, y
    n = continuous_width(spec)
    x = torch.empty(rows, manifest.tensors["features"].shape[0])
    x[:, :n] = torch.randn(rows, n, generator=g)
    for i, col in enumerate(spec.categorical):
        x[:, n + i] = torch.randint(0, stats.cardinality[col] + 1, (rows,), generator=g)
    y = torch.randint(0, max(1, stats.num_classes), (rows,), generator=g)
    return x, y
