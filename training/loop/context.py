"""`LoopContext`: what a training loop function gets, on every rank.

A loop is a function of one argument, `fn(ctx)`, named by `training.loop =
"pkg.module:function"` (its settings in `[training.loop_args]`) or given to
`shardline.train(config, loop=fn)`. shardline runs it on every rank of the job, on the
job's launcher (local processes, a Spark barrier stage, Dask workers), inside an
initialised process group (gloo on CPU, NCCL on GPUs): `torch.distributed` calls work as
under torchrun. Everything else shardline does — the shards, exact mid-epoch resume,
restarts of a lost rank, the one MLflow run, a registry without pickles — is reached
through the context:

    def train(ctx):
        model, opt = ctx.prepare(Net(ctx.inputs), lambda p: torch.optim.AdamW(p, lr=ctx.args["lr"]))
        loader = ctx.loader("train")
        state = {"model": model, "opt": opt, "loader": loader}
        step = ctx.restore(state) or 0          # a restart continues from the last ctx.save
        while loader.current_epoch < ctx.args["epochs"]:  # the loader's position counts the epochs
            for x, y in loader:                 # this epoch's batches (the rest, after a restore)
                loss = F.cross_entropy(model(ctx.to_device(x)), ctx.to_device(y))
                opt.zero_grad(); loss.backward(); opt.step(); step += 1
                if step % 100 == 0:
                    ctx.save(state, step=step)  # collective: every rank calls it
            ctx.log({"loss": loss.item()}, step=step)
        ctx.register(model, example=x)          # collective; rank 0's copy is registered

shardline's own training (the model-factory path, `training.loop` unset) is the loop in
`training.loop.builtin`, written on this same context: what a user's loop can do, the
built-in one does the same way.

Collective calls (every rank must make them, in the same order): `prepare`, `parallel`,
`save`, `restore`, `register`, `should_stop`. The others are each rank's own.

`shardline.context()` returns the rank's context from anywhere in its code
(training.loop.current). A function written for torchrun, run by `shardline.distribute`,
reaches its context that way: there it has no dataset, MLflow run or registry (`loader`,
`build_model`, `log` and `register` refuse in one line), and checkpoints when
`distribute` was given a `checkpoint_dir`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardline.foundation import progress
from shardline.foundation.errors import ConfigError, DataError

from .. import task
from ..batch import Inputs, to_device
from ..config import TrainingConfig
from ..loader.reader import ShardLoader
from ..models.inputs import ModelInputs

if TYPE_CHECKING:  # the rank's job and the strategies' rank objects: for annotations only
    from shardline.foundation.code_travel import UserCode
    from shardline.pipelines.manifest import ShardManifest

    from ..checkpoints.store import CheckpointStore
    from ..strategies.base import Parallel
    from .runner import RankJob

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class LoopContext:
    """What a training loop function gets: one per rank, made by shardline (never by you).

    Attributes (read them; do not assign):

    - `rank`, `world_size`: this rank and the number of ranks (as `torch.distributed`'s).
    - `local_rank`: this rank's index among the ranks on its host (its GPU's, on a GPU host).
    - `device`: where this rank computes (`cuda:<n>` on a GPU host, else `cpu`); the
      process group's collectives take tensors there.
    - `step`: the last step given to `ctx.save` (or restored by `ctx.restore`): the default
      step of `save` and `log`.
    - `args`: `training.loop_args`, the loop's own settings (a dict; `[training.loop_args]`
      in the TOML, `--set training.loop_args.lr=0.01`).
    - `config`: the job's `TrainingConfig` (batch_size, epochs, strategy, seed, ...).
    - `inputs`: the prepared dataset's `ModelInputs` (task, classes, feature width, named
      tensors' dtypes and shapes): what a model factory would be given.
    """

    def __init__(self, rank: int, world_size: int, job: RankJob, manifest: ShardManifest | None,
                 store: CheckpointStore | None, device: torch.device, local_rank: int = 0):
        self.rank, self.world_size, self.local_rank, self.device = rank, world_size, local_rank, device
        self.config: TrainingConfig = job.cfg
        self.args: dict[str, Any] = dict(job.cfg.loop_args)
        # None under shardline.distribute, which reads no dataset (and keeps checkpoints only
        # when given a folder: store None).
        self.inputs = ModelInputs.from_manifest(manifest) if manifest is not None else None
        self._job, self._manifest, self._store = job, manifest, store
        self._strategy = job.strategy
        # The data-parallel part this rank reads: the last Parallel's (ctx.parallel), else the strategy's mesh.
        self._data: tuple[int | None, int] | None = None
        self._reporter = None  # this rank's MLflow client, made at its first ctx.log
        self.step = 0  # the last step given to save/log: ctx.log's default step
        self.metrics: dict[str, float] = {}  # rank 0: the latest value of each name logged
        self.registered: dict | None = None  # rank 0: what ctx.register gave the driver
        self.stopped_early = False
        self.optimizer_steps: int | None = None  # the built-in loop's count (a user's loop: unknown)
        self._registering = False  # ctx.register was called (once a job)
        # ids of the job's models (ctx.build_model, and Parallels of them): register's default factory
        self._job_models: set[int] = set()
        self._parallels: list[Parallel] = []  # ctx.parallel's, closed after the loop (finish)
        self._plain: dict[int, nn.Module] = {}  # ctx.prepare's result -> the plain module it wraps

    # -- data ---------------------------------------------------------------------------

    def loader(self, split: str = "train", batch_size: int | None = None) -> ShardLoader:
        """shardline's loader over this rank's shards of `split` ("train", "val", "test").

        `batch_size`: the global batch, split evenly over the data-parallel ranks (default
        `training.batch_size`); each batch holds batch_size / data-parallel ranks rows. The
        batches are exactly what the model-factory path trains on: `(features, label)` for a
        tabular dataset, a dict of named tensors (`"label"` among them) for one with tensor
        or image columns; shuffled with `training.seed`, the same order on every run.

        Iterating it (`for batch in loader`) yields the current epoch's batches, the rest of
        it after a restore, and moves on to the next epoch when that one is done;
        `loader.epoch(e)` yields epoch `e`'s; `len(loader)` is the batches of an epoch. Its
        position is checkpointable: put the loader in the state given to `ctx.save` (it is a
        torch.distributed.checkpoint `Stateful`) and `ctx.restore` puts it back exactly,
        mid-epoch included. A split the dataset lacks: one line naming it and the dataset.

        The data-parallel ranks are the strategy's (the mesh's data dimension; after
        `ctx.parallel`, its Parallel's): the ranks that split one model read the same batches.
        """
        self._needs("a dataset", "ctx.loader")
        return _make_loader(self, split, batch_size)

    def to_device(self, batch: Inputs) -> Inputs:
        """A tensor, or a dict of tensors, on this rank's device (non-blocking from pinned memory)."""
        return to_device(batch, self.device)

    # -- models -------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        """The job's model, `training.model` (a built-in or your factory) built for this
        dataset with `training.model_args`, seeded so every rank starts equal, on the CPU.
        `ctx.register` of it (prepared or not) registers it under that factory."""
        from .register import build_job_model

        self._needs("a dataset", "ctx.build_model")
        return build_job_model(self)

    def prepare(self, model: nn.Module, optimizer_factory: OptimizerFactory | None = None):
        """The job's strategy applied to `model` (collective): the module to train with, and
        with `optimizer_factory` (`params -> optimizer`), `(module, optimizer)`.

        The job's mesh (`[training.mesh]`, or a strategy name's: `ddp`, `fsdp`, `tensor`) is
        applied in training.strategies.parallelize's order: tensor parallel by the model's
        `tp_plan()` (or `training.tensor.plan`; a model that declares none is refused in one
        line), activation checkpointing of its `recompute_units()`
        (`training.activation_checkpointing`), then data parallel: FSDP2 `fully_shard` of its
        units (its `fsdp_units()`, else each child of an `nn.Sequential`) and of the whole
        model over `dp_shard` (HSDP with `dp_replicate`), or `DistributedDataParallel` for plain
        replicas (`[training.ddp]`'s gradient compression).

        The model is moved to `ctx.device`; `training.precision = "bf16"` runs its forward
        under autocast. A mesh with pipeline stages (`pp` > 1) and `ps` run their own step:
        use `ctx.parallel`.
        Any of your own wrapping (your own `DistributedDataParallel`) works too: the process
        group is there. Every rank must pass the same (seeded) model.
        """
        from .prepare import prepare_module

        return prepare_module(self, model, optimizer_factory)

    def parallel(self, model: nn.Module | Callable[[], nn.Module], optimizer_factory: OptimizerFactory,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> Parallel:
        """The job's strategy as shardline's own loop runs it (collective): a `Parallel` whose
        `.step(x, y)` is one optimizer step on the global batch (forward, `loss_fn` —
        default the task's or `training.loss` —, backward, step) and returns `(output, loss)`
        where this rank reports them, else None. Every strategy has one, `pipeline` and `ps`
        included. `model`: the model, or a function building it (every rank the same; `fsdp`
        then builds it sharded, never whole on every rank). Its `.data_rank` / `.data_world`
        say which part of each batch this rank reads (`ctx.loader` follows them from now on;
        `data_rank` None: this rank reads none). A Parallel goes into `ctx.save`'s state as a
        whole (its model and optimizer state) and `ctx.register` takes it.
        `.step_sums(x, y, sums)` is the same step returning `((output, loss), sums(output, y, loss))`
        as the built-in loop counts its figures (`training.task.batch_sums`): a pipeline's last
        stage then adds them up a micro-batch at a time and keeps no outputs (output None), where
        `.step` holds the whole batch's.
        """
        from .prepare import make_parallel

        return make_parallel(self, model, optimizer_factory, loss_fn)

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, state: dict, step: int | None = None, *, epoch: int | None = None,
             artifact: bool = False) -> str | None:
        """Checkpoint `state` (collective: every rank calls it, with the same structure).

        `state` is a nested dict of: `nn.Module`s (plain, DDP, FSDP2, tensor parallel),
        optimizers (each paired with the module(s) in the state whose parameters it holds),
        LR schedulers, `Stateful` objects (anything with `state_dict()` and
        `load_state_dict()`: the loaders, a Parallel), tensors, and plain numbers, strings,
        lists and dicts. Tensors are written with torch.distributed.checkpoint (DCP), each
        rank its part (a DTensor's shards; a tensor every rank holds, once); plain values
        are kept per rank in the checkpoint's small file, with each rank's RNG states (CPU,
        and its GPU's), which shardline saves itself. The checkpoint is committed through the
        job's store (`training.checkpoint_dir`: its `LATEST` moves last, the newest
        `training.keep_checkpoints` are kept) and is what a restart or `--resume` restores.

        `step`: the checkpoint's step (its name sorts by it; default: the last step given).
        `epoch`: whole epochs done by then, for loops that count them (a `--resume` of a job
        whose checkpoint has `training.epochs` done is refused). `artifact`: also log it to
        the MLflow run as an artifact (it is always recorded there by reference).
        Returns the checkpoint's URL on rank 0, None on the others.
        """
        from .state import save_state

        if self._store is None:
            raise ConfigError("ctx.save: shardline.distribute was given no checkpoint_dir: give it one "
                              "(distribute(fn, ..., checkpoint_dir=URL)) for ctx.save and ctx.restore")
        return save_state(self, state, self._step(step), epoch=epoch, artifact=artifact)

    def restore(self, state: dict) -> int | None:
        """Load the job's checkpoint into `state` in place (collective), as `ctx.save` wrote
        it: modules, optimizers, schedulers, loaders' positions and tensors loaded into the
        objects given, plain values put back into their dicts; returns its step. None when
        there is nothing to restore (a new job), and `state` is left as it is.

        The checkpoint is the one the driver chose: the last committed one after a lost rank
        was relaunched, the one `--resume` continues. Each rank's RNG states are restored at
        the world size that saved them. The state must have the structure saved (a missing
        or extra entry is one line naming it); a checkpoint written at another world size
        reshards (DCP), mid-epoch only with the same data-parallel degree."""
        from .state import restore_state

        return restore_state(self, state)

    # -- tracking and the console ---------------------------------------------------------

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log figures to the job's one MLflow run (not collective: call it on any rank).
        Rank 0's go in under their names, another rank's as `rank<r>_<name>`. `step`: default
        the last step given to `save`. Never waits on MLflow: while its server is
        unreachable the figures are kept, and sent by the driver when training ends."""
        from .tracking import log_metrics

        self._needs("an MLflow run", "ctx.log")
        log_metrics(self, metrics, self.step if step is None else int(step))

    def say(self, text: str) -> None:
        """One line on the driver's console (wherever this rank runs); another rank's
        line starts with `[rank <r>]`."""
        progress.say(self._job.progress_addr, text if self.rank == 0 else f"[rank {self.rank}] {text}")

    def should_stop(self, epoch: int | None = None, metrics: dict[str, float] | None = None) -> bool:
        """True on every rank when the job asks the loop to stop early (collective): a sweep's
        pruner, judging rank 0's `metrics` after `epoch` (call it once per epoch). A loop that
        stops returns as usual. (A job whose driver was interrupted needs no asking: its ranks
        end at once, and commit no further checkpoint.)"""
        from .tracking import stop_requested

        return stop_requested(self, epoch, metrics)

    def register(self, model, example: Inputs | None = None, factory: str | Callable | None = None,
                 args: dict | None = None) -> None:
        """Register `model` as the job's model, `tracking.registered_model` (collective).

        A sharded model's weights are gathered to rank 0 a tensor at a time; the driver
        logs and registers them when the ranks are done, in the format of factory models:
        safetensors weights, the job's code, and the import path and arguments that rebuild
        the module (loading never unpickles), so `shardline score` and `mlflow models serve`
        take it. `factory`: what rebuilds it — default `training.model`'s factory when
        `model` is the job's (`ctx.build_model()`, prepared or not, or a Parallel), else the
        model's class (`module:QualName`) called as `factory(**args)`; rank 0 checks that
        it rebuilds a module with the same state-dict keys and shapes (else one line).
        `example`: one batch of the model's inputs (a tensor, or a dict of named tensors as
        the loader yields them) that defines its input signature: inputs named like the
        dataset's columns take raw rows (the dataset's transform is inside), other inputs
        arrays of their dtype and shape; an output that is not the task's ([batch, classes]
        or [batch] values) is scored as a list column `output`. One model per job: a loop
        that registers none finishes with no model registered (`TrainResult.model_uri` None).
        """
        from .register import register_model

        self._needs("a registered model", "ctx.register")
        register_model(self, model, example, factory, args)

    def autocast(self):
        """The job's precision as a context manager: `with ctx.autocast(): loss = ...` runs
        under bf16 autocast when `training.precision = "bf16"`, else changes nothing."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16")

    # -- internals --------------------------------------------------------------------------

    def finish(self) -> list[tuple]:
        """After the loop returned: each ctx.parallel closed (Parallel.close: what must complete
        before the rank leaves); then the MLflow calls this rank's client could not send yet
        (the driver sends them), the last try made first."""
        from .tracking import pending

        for parallel in self._parallels:
            parallel.close()
        return pending(self)

    def _needs(self, what: str, call: str) -> None:
        """One line for a call a `shardline.distribute` function cannot make: it has no dataset,
        MLflow run or registered model (a loop run by `shardline.train(config, loop=fn)` has)."""
        if self._job.call is not None:
            raise ConfigError(
                f"{call}: a function run by shardline.distribute has no {what}; train it as a loop "
                "(shardline.train(config, loop=fn), fn(ctx)) for the dataset's shards, one MLflow run and the registry"
            )

    def _step(self, step: int | None) -> int:
        if step is not None:
            self.step = int(step)
        return self.step

    @property
    def code(self) -> UserCode | None:
        return self._job.code

    def data_part(self) -> tuple[int | None, int]:
        """(data-parallel rank, degree) this rank reads: the last Parallel's, else the mesh's."""
        if self._data is not None:
            return self._data
        world = self._strategy.data_world
        if world == self.world_size:  # every rank reads its own part (ddp, fsdp)
            return self.rank, world
        mesh = self._strategy.mesh
        if mesh is not None and mesh.data_world == world:  # the ranks that split one model read the same part
            return mesh.data_rank(self.rank), world
        # A parameter server's workers read (ranks 0..workers-1); its servers read nothing.
        return (self.rank if self.rank < world else None), world


def _make_loader(ctx: LoopContext, split: str, batch_size: int | None) -> ShardLoader:
    cfg, manifest = ctx.config, ctx._manifest
    if split not in manifest.splits:
        raise DataError(
            f"ctx.loader: the dataset {ctx._job.dataset_dir} has no split '{split}' "
            f"(its splits: {', '.join(manifest.splits)})"
        )
    data_rank, data_world = ctx.data_part()
    batch = cfg.batch_size if batch_size is None else batch_size
    if batch < data_world:
        raise ConfigError(f"ctx.loader: batch_size {batch} is less than the {data_world} data-parallel ranks")
    # A rank that reads no data (a parameter server) keeps a loader too, over rank 0's part:
    # it counts the steps of an epoch and the position to resume from, as every rank does.
    return ShardLoader(
        manifest, ctx._job.dataset_dir, split, data_rank if data_rank is not None else 0, data_world,
        batch // data_world, cfg.seed, remainder=cfg.remainder, shuffle_buffer_rows=cfg.shuffle_buffer_rows,
        workers=cfg.loader_workers_for(manifest.plan), prefetch=cfg.prefetch_depth, verify=cfg.verify_shards,
        # Regression with the default loss learns the standardised label (training.task).
        label_scale=task.label_scale(manifest, cfg.loss),
    )
