"""The one interface every parallel strategy implements.

A `Strategy` is resolved once per job from the config (strategies.strategy_for), holding
its own settings sub-table and its mesh. It checks the config against a model before any
process starts, and on each rank (inside an initialised process group) turns the plain model into a
`Parallel`: the rank's share of the model, its optimizer and its step. The
loop (training.loop.builtin) only ever talks to a `Parallel`, so it runs every
strategy the same way on every launcher, and the model never knows how it is
parallelised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardline.foundation.errors import ConfigError

from .. import collectives
from ..batch import Inputs, forward
from ..checkpoints.state import read_tensors, write_tensors
from ..config import TrainingConfig
from ..models.inputs import ModelInputs
from ..task import LossFn, task_loss

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
# The seeded plain model, on the default device (it seeds itself: the same weights at every
# call). A strategy whose `builds_model` is True takes one in place of the model and calls it
# under torch.device("meta") on every rank, and for real where it needs the values (fsdp).
ModelBuilder = Callable[[], nn.Module]


@dataclass(frozen=True)
class Mesh:
    """The degrees of a 2-D device mesh: `dp` data-parallel groups of `inner` ranks that
    split one model (tensor or pipeline). Rank = dp_index * inner + inner_index: the
    ranks of one model replica are neighbours (on one host, when hosts fill in order),
    which is also the row-major order `init_device_mesh` lays ranks out in."""

    dp: int
    inner: int = 1
    # The inner dimension's name in the DeviceMesh ("tp", "pp"): mesh[name] is its sub-mesh.
    inner_name: str = "inner"

    def dp_index(self, rank: int) -> int:
        return rank // self.inner

    def inner_index(self, rank: int) -> int:
        return rank % self.inner

    def device_mesh(self, device: torch.device) -> DeviceMesh:
        """torch's DeviceMesh of shape (dp, inner), dimensions named ("dp", inner_name),
        for `device`'s type: `mesh["dp"]`, `mesh[inner_name]` are the 1-D sub-meshes
        DTensor, FSDP2 and pipelining take, `.get_group()` their process groups.
        Collective: every rank builds it, in the same order, as torch.distributed requires."""
        return init_device_mesh(device.type, (self.dp, self.inner), mesh_dim_names=("dp", self.inner_name))

    def groups(self, rank: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """(this rank's dp group, its inner group), None for a dimension of size 1.
        Collective: every rank creates every group in the same order."""
        dp_group = inner_group = None
        for i in range(self.inner):
            ranks = [d * self.inner + i for d in range(self.dp)]
            g = dist.new_group(ranks) if self.dp > 1 else None
            if rank in ranks:
                dp_group = g
        for d in range(self.dp):
            ranks = [d * self.inner + i for i in range(self.inner)]
            g = dist.new_group(ranks) if self.inner > 1 else None
            if rank in ranks:
                inner_group = g
        return dp_group, inner_group


# The degrees a strategy may split (or shard) one model replica by: one per strategy.
SPLIT_DEGREES = ("tp", "pp", "dp_shard")


def mesh_for(cfg: TrainingConfig, inner_setting: str | None) -> Mesh:
    """The mesh `cfg` asks for: `inner_setting` names the split degree ("tp", "pp" or
    "dp_shard"; None for strategies with none). An unset degree takes what the others
    leave; both unset, the whole world splits one replica."""
    world = cfg.world_size
    others = [s for s in SPLIT_DEGREES if s != inner_setting and getattr(cfg, s) not in (None, 1)]
    if others:
        raise ConfigError(
            f"training.{others[0]} = {getattr(cfg, others[0])}: strategy '{cfg.strategy}' "
            f"splits the model only by {inner_setting or 'data'} "
            "(combinations: dp x tp, dp x pp, dp x dp_shard)"
        )
    dp = cfg.dp
    if inner_setting is None:
        if dp not in (None, world):
            raise ConfigError(
                f"training.dp {dp} must equal training.world_size {world}: strategy "
                f"'{cfg.strategy}' has no other mesh dimension"
            )
        return Mesh(world)
    inner = getattr(cfg, inner_setting)
    given = [(name, v) for name, v in (("dp", dp), (inner_setting, inner)) if v is not None]
    if len(given) == 1 and world % given[0][1]:
        name, v = given[0]
        raise ConfigError(f"training.{name} {v} must divide training.world_size {world}")
    if inner is None:
        inner = world // (dp or 1)
    if dp is None:
        dp = world // inner
    if dp * inner != world:
        raise ConfigError(
            f"training.dp {dp} x training.{inner_setting} {inner} = {dp * inner} must equal "
            f"training.world_size {world}"
        )
    return Mesh(dp, inner, inner_setting)


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

    # Checkpoints: every rank writes what it holds with torch.distributed.checkpoint,
    # keyed by the plain model's names, and reads what it holds now, so every strategy's
    # checkpoints reshard (training.checkpoints.sharded). A loop's ctx.save takes these
    # parts (training.loop.state): the one checkpoint path.

    def checkpoint_parts(self, restoring: bool = False) -> dict[str, object]:
        """What this rank holds, as checkpoint state: {"model": ..., "optimizer": ...}, each
        a module or optimizer torch's state-dict API names by the plain model's names, or a
        Stateful that names them itself (training.checkpoints.named). `restoring`: the parts
        to read into, where they differ from those written (a ps worker writes nothing and
        reads its whole replica). Default: the rank's `model` and `optimizer`."""
        parts: dict[str, object] = {"model": self.model}
        if self.optimizer is not None:
            parts["optimizer"] = self.optimizer
        return parts

    def save_checkpoint(self, directory: str) -> None:
        """Write this rank's weights and optimizer state (tensors: the hyperparameters are
        a checkpoint's small file's) into the DCP directory. Collective."""
        write_tensors(self.checkpoint_parts(), directory)

    def load_checkpoint(self, directory: str) -> None:
        """Read this rank's weights and optimizer state, whichever ranks wrote them. Collective."""
        read_tensors(self.checkpoint_parts(restoring=True), directory)

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

    def __init__(self, settings: BaseModel | None, mesh: Mesh | None, data_world: int):
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

    def model_for(self, build: ModelBuilder, device: torch.device) -> nn.Module | ModelBuilder:
        """What `setup` takes: `build` itself where the strategy builds the model (sharded,
        never whole on every rank), else the plain model on `device`."""
        return build if self.builds_model else build().to(device)

    def prepare_module(self, model: nn.Module, cfg: TrainingConfig, world_size: int,
                       device: torch.device) -> nn.Module:
        """The strategy applied to a module of a user's own loop (LoopContext.prepare), which
        then runs its own forward, backward and optimizer step: the module on `device`,
        wrapped or sharded in place. Collective. Strategies whose step is their own (they
        split the step itself: pipeline, ps) refuse it, in one line."""
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


def autocast_for(device: torch.device, cfg: TrainingConfig) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


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


def average_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None, degree: int) -> None:
    """The mean of each gradient over a data-parallel group, in one flat all-reduce: with
    equal local batches, the mean of the replicas' mean-loss gradients is the global one."""
    if group is None or not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    collectives.all_reduce(flat, group=group)
    flat /= degree
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)
