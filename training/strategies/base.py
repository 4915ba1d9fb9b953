"""The one interface every parallel strategy implements.

A `Strategy` is resolved once per job from the config (strategies.strategy_for), holding
its own settings and its mesh. It checks the config against a model before any process
starts, and on each rank (inside an initialised process group) turns the plain model into a
`Parallel`: the rank's share of the model, its optimizer and its step. The loop
(training.loop.builtin) only ever talks to a `Parallel`, so it runs every strategy the same
way on every launcher, and the model never knows how it is parallelised.

A `Parallel`'s checkpoint parts (`checkpoint_parts`: the module and optimizer of what the
rank holds, under the plain model's names) are the one checkpoint path of every mesh and of
ps (training.checkpoints.state, .sharded): a loop's checkpoint takes them as its state, and
`save_checkpoint`/`load_checkpoint` write and read them alone with a directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from pydantic import BaseModel
from torch import nn

from shardline.foundation.errors import ConfigError

from ..batch import Inputs, forward
from ..checkpoints.state import read_tensors, write_tensors
from ..config import TrainingConfig
from ..mesh_shape import MeshShape
from ..models.inputs import ModelInputs
from ..task import LossFn, task_loss
from .grid import RankPlace, mesh_grid

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
# The seeded plain model, on the default device (it seeds itself: the same weights at every
# call). A strategy whose `builds_model` is True takes one in place of the model and calls it
# under torch.device("meta") on every rank, and for real where it needs the values (fsdp).
ModelBuilder = Callable[[], nn.Module]
# (outputs, labels, mean loss) -> the batch's sums (training.task.batch_sums for the job's task).
BatchSums = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Parallel:
    """One rank's share of a parallel model: what a strategy's `setup` returns. The defaults
    here are the optional parts; every strategy's rank class fills in the rest."""

    # Which part of each global batch this rank reads: the loader's rank and world
    # size (the data-parallel index and degree). data_rank None: reads no data.
    data_rank: int | None
    data_world: int
    # True on exactly one rank per data_rank: its losses and samples count in the totals.
    reports: bool
    # The optimizer whose learning rate the schedule drives; None if this rank has none.
    optimizer: torch.optim.Optimizer | None
    # True where a rank holds shards (fsdp): it evaluates with `forward_eval` (every rank,
    # in lockstep) in place of a plain model loaded with full_state_dict.
    evaluates_sharded: bool = False

    def step(self, x: Inputs | None, y: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One optimizer step on the global batch; (logits, mean loss) of this rank's
        batch where `reports`, else None. x is the features tensor or the named tensors
        (training.batch); x, y are None where data_rank is None."""
        raise NotImplementedError

    def step_sums(self, x: Inputs | None, y: torch.Tensor | None, sums: BatchSums
                  ) -> tuple[tuple[torch.Tensor | None, torch.Tensor] | None, torch.Tensor | None]:
        """`step`, and `sums(outputs, y, mean loss)` of its batch (training.task.batch_sums: what
        the epoch's figures add up) where `reports`, else None. A strategy that sees the batch a
        micro-batch at a time (pipeline) sums each as it comes and keeps no outputs: its
        (outputs, loss) then has outputs None."""
        out = self.step(x, y)
        return out, (sums(out[0], y, out[1]) if out is not None and y is not None else None)

    def forward_eval(self, x: Inputs) -> torch.Tensor:
        """Where `evaluates_sharded`: the sharded model's outputs. Collective: every rank
        calls it equally often."""
        raise NotImplementedError(f"{type(self).__name__} evaluates a plain model (evaluates_sharded False)")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's weights, on every rank, for a plain evaluation model. Collective."""
        raise NotImplementedError

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's weights on rank 0, in host memory, for the registered model;
        {} elsewhere. Rank 0 receives them a tensor at a time from the ranks that hold them,
        never gathered on every rank. Collective (its ranks that hold weights)."""
        raise NotImplementedError

    # Checkpoints: one path for every mesh. Every rank writes what it holds with
    # torch.distributed.checkpoint, keyed by the plain model's names, and reads what it holds
    # now, so every layout's checkpoints reshard to every other (training.checkpoints.sharded).

    def checkpoint_parts(self, restoring: bool = False) -> dict[str, Any]:
        """What this rank holds, as checkpoint state: {"model": a module whose state-dict names
        are the plain model's (its tensors DTensors where sharded or split), "optimizer": the
        optimizer over its parameters} (no optimizer: no "optimizer"). `restoring`: the parts
        to read into, where they differ from those written (a ps worker writes nothing and
        reads its whole replica). Default: the rank's `model` and `optimizer`."""
        parts: dict[str, Any] = {"model": self.model}
        if self.optimizer is not None:
            parts["optimizer"] = self.optimizer
        return parts

    def save_checkpoint(self, directory: str) -> None:
        """Write this rank's part (tensors: the optimizers' hyperparameters are a checkpoint's
        small file's) into the DCP directory. Collective."""
        write_tensors(self.checkpoint_parts(), directory)

    def load_checkpoint(self, directory: str) -> None:
        """Read this rank's part, whichever mesh and ranks wrote it. Collective."""
        read_tensors(self.checkpoint_parts(restoring=True), directory)

    def close(self) -> None:
        """After this rank's last step, before it leaves the group: what must complete first
        (a ps server's replies still in flight). Every rank calls it once. Default: nothing."""

    def epoch_metrics(self) -> dict[str, float]:
        """The strategy's own figures since the last call (push/pull time, bubble ...),
        this rank's, each named `<strategy>_...`; rank 0 logs every rank's to MLflow."""
        return {}


class Strategy:
    """A parallel strategy, resolved once per job from the config (strategies.strategy_for):
    its own settings (its sub-table, e.g. [training.pipeline]) and its mesh, computed once.
    The driver checks with it before any process starts; it travels to every rank inside the
    job, where `setup` turns the plain model into the rank's Parallel. The general training
    settings (batch_size, precision, loss, ...) come with each call, in `cfg`."""

    name: ClassVar[str]
    # True: `setup` takes a ModelBuilder and builds the model itself, sharded, never whole
    # on every rank (fsdp); False: it takes the plain model (`model_for`).
    builds_model: ClassVar[bool] = False

    def __init__(self, settings: BaseModel | None, mesh: MeshShape | None, data_world: int):
        self.settings = settings
        # The device mesh's degrees; None where the strategy has no mesh (ps).
        self.mesh = mesh
        # How many parts each global batch is read in (Parallel.data_world on every rank).
        self.data_world = data_world

    def check(self, cfg: TrainingConfig, model: nn.Module, inputs: ModelInputs | None = None) -> None:
        """Refuse, with one line naming the setting, what cannot run: before any process starts.
        inputs: the dataset's shape, for checks that run the model on a sample batch (a
        pipeline's layers composing into its forward); None leaves those out."""

    def describe(self, cfg: TrainingConfig, model: nn.Module) -> str:
        """What the strategy will do, printed on the driver at start; "" when it has nothing to say."""
        return ""

    def place(self, cfg: TrainingConfig, model: nn.Module, rank: int) -> RankPlace:
        """Where `rank` sits: its coordinates, what it holds, which data part it reads."""
        return RankPlace(coordinates={"rank": rank}, data_rank=rank)

    def grid(self, cfg: TrainingConfig, model: nn.Module, manifest, hosts: list[str] | None = None) -> str:
        """Every rank's place as a table (grid.mesh_grid): `shardline plan` prints it, a run
        logs it. model: the plain model (on the meta device will do: only its structure is read)."""
        places = [self.place(cfg, model, r) for r in range(cfg.world_size)]
        return mesh_grid(cfg, places, self.data_world, manifest, hosts, self.title(cfg))

    def title(self, cfg: TrainingConfig) -> str:
        return f"{self.name}: {cfg.world_size} rank(s)"

    def model_for(self, build: ModelBuilder, device: torch.device) -> nn.Module | ModelBuilder:
        """What `setup` takes: `build` itself where the strategy builds the model (sharded,
        never whole on every rank), else the plain model on `device`."""
        return build if self.builds_model else build().to(device)

    def prepare_module(self, model: nn.Module, cfg: TrainingConfig, world_size: int,
                       device: torch.device) -> nn.Module:
        """The strategy applied to a module of a user's own loop, which then runs its own
        forward, backward and optimizer step: the module on `device`, wrapped or sharded in
        place. Collective. A strategy whose step is its own (ps) refuses it, in one line."""
        raise ConfigError(
            f"ctx.prepare: strategy '{self.name}' runs its own step (it splits the step itself, not "
            "just the module): use ctx.parallel(model, optimizer_factory) and its .step(x, y)"
        )

    def setup(
        self,
        model: nn.Module | ModelBuilder,
        cfg: TrainingConfig,
        rank: int,
        world_size: int,
        device: torch.device,
        make_optimizer: OptimizerFactory,
    ) -> Parallel:
        """This rank's Parallel. Every rank passes the same (seeded) plain model, or, to a
        strategy whose `builds_model` is True, the same ModelBuilder (`model_for`)."""
        raise NotImplementedError


def train_step(model, optimizer, autocast, x: Inputs, y: torch.Tensor, loss_fn: LossFn = task_loss):
    """Forward (features, or named tensors as keywords: training.batch), loss (the task's,
    or training.loss: task.loss_for), backward, optimizer step; returns (logits, loss)."""
    with autocast:
        logits = forward(model, x)
        loss = loss_fn(logits, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return logits, loss
