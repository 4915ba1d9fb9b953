"""Parameter server: workers compute gradients, servers own the parameters and step them.

Ranks 0..W-1 are workers (each a full replica of the model, reading data slice
`rank`); the last S ranks are servers, each owning whole parameters (a shard,
balanced by size) and the optimizer for them.

sync: each step every worker reduces its gradient for a shard to that shard's
server, which steps on the mean (the mean of W equal local means is the global
batch's mean gradient) and broadcasts the new values back: single-process
training on the global batch.

async: workers and servers exchange point-to-point messages. A server applies each
worker's gradient the moment it arrives and replies with its current values; stale
synchronous parallel bounds how far a worker may run ahead of the slowest one.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from shardline.foundation.errors import ConfigError

from .. import collectives
from ..batch import forward
from ..checkpoints import sharded
from ..config import TrainingConfig
from ..mesh_shape import mesh_of
from ..models.inputs import ModelInputs
from ..task import loss_for
from ..strategy_settings import PsSettings
from .base import OptimizerFactory, Parallel, Strategy
from .grid import RankPlace
from .parallelize import apply_recompute, recompute_paths
from .precision import Precision


class ParameterServer(Strategy):
    name = "ps"
    settings: PsSettings

    def __init__(self, cfg: TrainingConfig):
        mesh_of(cfg)  # refuses a mesh dimension above 1: servers own whole parameters
        workers = cfg.world_size - cfg.ps.servers
        if workers < 1:
            raise ConfigError(
                f"training.ps.servers {cfg.ps.servers} leaves no worker rank "
                f"(training.world_size {cfg.world_size})"
            )
        # No device mesh: the workers read the data, the servers hold the parameters.
        super().__init__(cfg.ps, None, workers)

    def check(self, cfg: TrainingConfig, model: nn.Module, inputs: ModelInputs | None = None) -> None:
        workers, servers = self.data_world, self.settings.servers
        if cfg.batch_size % workers:
            raise ConfigError(
                f"training.batch_size {cfg.batch_size} must be a multiple of the {workers} ps "
                f"workers (training.world_size - training.ps.servers)"
            )
        recompute_paths(cfg.activation_checkpointing, model, f"training.model {cfg.model}")
        n_params = len(list(model.parameters()))
        if servers > n_params:
            raise ConfigError(
                f"training.ps.servers {servers} exceeds the model's {n_params} parameter "
                f"tensors (a server owns whole parameters)"
            )
        if any(True for _ in model.buffers()):
            # Servers hold parameters only; running statistics would differ per worker.
            raise ConfigError(
                f"training.strategy ps: model '{cfg.model}' has buffers (running statistics), "
                f"which parameter servers do not hold"
            )

    def title(self, cfg: TrainingConfig) -> str:
        return (f"ps: {self.data_world} worker(s), {self.settings.servers} server(s) ({self.settings.mode}); "
                f"each batch read in {self.data_world} part(s)")

    def place(self, cfg: TrainingConfig, model: nn.Module, rank: int) -> RankPlace:
        if rank < self.data_world:
            return RankPlace({"worker": rank, "server": "-"}, "all layers (a replica)", "whole", rank)
        names = shard_names(model, self.settings.servers)[rank - self.data_world]
        size = sum(p.numel() for n, p in model.named_parameters() if n in names)
        return RankPlace({"worker": "-", "server": rank - self.data_world}, "none",
                         f"{len(names)} parameter tensor(s), {size:,} values", None)

    def setup(
        self, model: nn.Module, cfg: TrainingConfig, rank: int, world_size: int,
        device: torch.device, make_optimizer: OptimizerFactory,
    ) -> WorkerRank | ServerRank:
        layout = Layout(model, self.settings, world_size)
        model.to(device)
        apply_recompute(model, recompute_paths(cfg.activation_checkpointing, model, f"training.model {cfg.model}"))
        if rank < layout.workers:
            return WorkerRank(model, cfg, rank, layout, device)
        return ServerRank(model, cfg, rank, layout, device, make_optimizer)


def shard_names(model: nn.Module, servers: int) -> list[list[str]]:
    """Parameter names per server: largest first to the least-loaded server (ties: the
    lower index), so every rank computes the same balanced split. Model order within."""
    params = list(model.named_parameters())
    loads, shards = [0] * servers, [[] for _ in range(servers)]
    for name, p in sorted(params, key=lambda np: -np[1].numel()):  # stable: ties keep model order
        s = loads.index(min(loads))
        shards[s].append(name)
        loads[s] += p.numel()
    order = {name: i for i, (name, _) in enumerate(params)}
    return [sorted(names, key=order.__getitem__) for names in shards]


class Layout:
    """What every rank knows: who is a worker, which server owns which parameters, their
    shapes, and the process groups. Built on every rank, in the same order (collective)."""

    def __init__(self, model: nn.Module, settings: PsSettings, world_size: int):
        self.mode, self.staleness = settings.mode, settings.staleness
        self.workers = world_size - settings.servers
        self.shards = shard_names(model, settings.servers)
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.names = list(self.shapes)  # model order: full_state_dict's
        self.dtype = next(model.parameters()).dtype
        if self.mode == "sync":
            # Server s with every worker: its reduce (push) and broadcast (pull).
            self.groups = [
                dist.new_group(list(range(self.workers)) + [self.server_rank(s)])
                for s in range(settings.servers)
            ]
        else:
            # gloo whatever the world's backend: it can receive from any source (a
            # server serves pushes in arrival order), which NCCL cannot.
            self.p2p = collectives.new_host_group()

    def server_rank(self, s: int) -> int:
        return self.workers + s

    def size(self, s: int) -> int:
        return sum(self.shapes[n].numel() for n in self.shards[s])


def _flat(tensors) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([t.reshape(-1) for t in tensors])


def _copy_flat(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    with torch.no_grad():
        for p, chunk in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(chunk.view_as(p))


def _gather_full(
    layout: Layout, device: torch.device, own: int | None, values=()
) -> dict[str, torch.Tensor]:
    """The plain model's weights on every rank (collective): each server broadcasts its
    shard to the whole world, so the servers' values are the truth even where an async
    worker's replica is a few versions behind. `own`: this rank's server index, if any."""
    out = {}
    for s, names in enumerate(layout.shards):
        if s == own:
            flat = _flat(values)
        else:
            flat = torch.empty(layout.size(s), dtype=layout.dtype, device=device)
        collectives.broadcast(flat, layout.server_rank(s))
        for name, chunk in zip(names, flat.split([layout.shapes[n].numel() for n in names])):
            out[name] = chunk.view(layout.shapes[name])
    return {name: out[name] for name in layout.names}


class WorkerRank(Parallel):
    """A replica: gradients on the local batch out, the servers' values in."""

    def __init__(self, model, cfg, rank, layout: Layout, device):
        self.model, self.layout, self.device = model, layout, device
        self.autocast = Precision.of(cfg).autocast(device)
        self.loss = loss_for(cfg)
        params = dict(model.named_parameters())
        self.shards = [[params[n] for n in names] for names in layout.shards]
        self.data_rank, self.data_world, self.reports = rank, layout.workers, True
        self.optimizer = None
        self.push_s = self.pull_s = 0.0
        self.steps = 0

    def step(self, x, y):
        self.model.train()
        with self.autocast:
            logits = forward(self.model, x)
            loss = self.loss(logits, y)
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        grads = [
            _flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in shard)
            for shard in self.shards
        ]
        exchange = self._sync if self.layout.mode == "sync" else self._async
        for shard, flat in zip(self.shards, exchange(grads)):
            _copy_flat(flat, shard)
        self.steps += 1
        return logits, loss

    def _sync(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        t = time.perf_counter()
        layout = self.layout
        for work in [
            collectives.reduce(g, layout.server_rank(s), group=layout.groups[s], async_op=True)
            for s, g in enumerate(grads)
        ]:
            work.wait()
        self.push_s += time.perf_counter() - t
        t = time.perf_counter()
        values = [torch.empty_like(g) for g in grads]
        for work in [
            collectives.broadcast(v, layout.server_rank(s), group=layout.groups[s], async_op=True)
            for s, v in enumerate(values)
        ]:
            work.wait()
        self.pull_s += time.perf_counter() - t
        return values

    def _async(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        # No version travels with a push: a worker always computes on the last values a
        # server sent it, so the server knows the version it was computed on.
        t = time.perf_counter()
        layout = self.layout
        grads = [g.cpu() for g in grads]  # the gloo group sends host memory
        for work in [
            collectives.isend(g, layout.server_rank(s), group=layout.p2p) for s, g in enumerate(grads)
        ]:
            work.wait()
        self.push_s += time.perf_counter() - t
        t = time.perf_counter()
        values = []
        for s, g in enumerate(grads):
            v = torch.empty_like(g)
            collectives.recv(v, layout.server_rank(s), group=layout.p2p)
            values.append(v.to(self.device))
        self.pull_s += time.perf_counter() - t
        return values

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return _gather_full(self.layout, self.device, None)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """On rank 0 (worker 0): the servers' values, received a tensor at a time (an async
        worker's replica may be a few versions behind them). Other workers: {}."""
        if self.data_rank != 0:
            return {}
        out = {}
        for s, names in enumerate(self.layout.shards):
            for name in names:
                t = torch.empty(self.layout.shapes[name], dtype=self.layout.dtype, device=self.device)
                collectives.recv(t, self.layout.server_rank(s))
                out[name] = t.cpu()
        return {name: out[name] for name in self.layout.names}

    def checkpoint_parts(self, restoring: bool = False) -> dict:
        """A worker writes nothing (its replica is the servers' values, maybe a few versions
        behind them) and reads its whole replica from what the servers wrote."""
        return {"model": self.model} if restoring else {}

    def epoch_metrics(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        out = {"ps_push_ms": 1e3 * self.push_s / steps, "ps_pull_ms": 1e3 * self.pull_s / steps}
        self.push_s = self.pull_s = 0.0
        self.steps = 0
        return out


class ServerRank(Parallel):
    """Owns one shard and its optimizer; keeps no reference to the rest of the model."""

    def __init__(self, model, cfg, rank, layout: Layout, device, make_optimizer):
        self.layout, self.device, self.rank = layout, device, rank
        params = dict(model.named_parameters())
        self.server = rank - layout.workers
        self.shard = {n: params[n] for n in layout.shards[self.server]}
        self.shard_module = sharded.module_of(self.shard)  # its state-dict names are the plain model's
        self.size = layout.size(self.server)
        self.optimizer = make_optimizer(list(self.shard.values()))
        self.data_rank, self.data_world, self.reports = None, layout.workers, False
        # async: the model version (pushes applied), pushes per worker (its clock), the
        # version each worker last received, replies held back, and replies in flight:
        # a gloo send whose Work is dropped before the worker receives it never arrives.
        self.version = 0
        self.clocks = [0] * layout.workers
        self.sent = [0] * layout.workers
        self.held: list[tuple[int, int]] = []
        self.sending: list[dist.Work] = []
        self.stale_sum = self.stale_max = self.pushes = 0

    def step(self, x, y):
        if self.layout.mode == "sync":
            self._sync()
        else:
            self._serve()
        return None

    def _sync(self) -> None:
        group = self.layout.groups[self.server]
        grad = torch.zeros(self.size, dtype=self.layout.dtype, device=self.device)
        collectives.reduce(grad, self.rank, group=group)  # the server adds zeros: the workers' sum
        self._apply(grad / self.layout.workers)
        collectives.broadcast(_flat(self.shard.values()), self.rank, group=group)

    def _serve(self) -> None:
        """Exactly W pushes, in arrival order (from any worker).

        Why W per call keeps servers and workers aligned: between two collectives of the
        training loop (step logging, epoch end, checkpoints) every rank steps the same
        number of times n, and no worker can push again before the collective completes,
        which needs the servers too. So the W*n pushes a server serves before it reaches
        the collective are exactly those made since the last one: none is left unread
        across it and none it waits for lies beyond it. The last of them levels every
        clock, so no reply is held there either.
        """
        for _ in range(self.layout.workers):
            grad = torch.empty(self.size, dtype=self.layout.dtype)
            worker = collectives.recv(grad, group=self.layout.p2p)
            stale = self.version - self.sent[worker]
            self.stale_sum += stale
            self.stale_max = max(self.stale_max, stale)
            self.pushes += 1
            self._apply(grad.to(self.device))
            self.version += 1
            self.clocks[worker] += 1
            self.held.append((worker, self.clocks[worker]))
            self._release()
        self.sending = [w for w in self.sending if not w.is_completed()]

    def _release(self) -> None:
        """Reply to each held push whose worker is at most `staleness` pushes ahead of the
        slowest: the reply to push c waits until every worker has pushed c - k times.
        The slowest worker's reply is never held, so some worker always moves on.

        The bound: a worker's push c is computed on the values sent when its push c-1
        was released (every other worker then at >= c-1-k pushes) and applied before
        any other worker passes c+k pushes (their push c+k+1 waits for this worker's
        c-th). So its staleness (pushes applied in between) is at most (W-1)(2k+1).
        """
        slowest = min(self.clocks)
        ready = [(w, c) for w, c in self.held if c - self.layout.staleness <= slowest]
        if not ready:
            return
        self.held = [(w, c) for w, c in self.held if c - self.layout.staleness > slowest]
        values = _flat(self.shard.values()).cpu()
        for worker, _ in ready:
            self.sent[worker] = self.version
            self.sending.append(collectives.isend(values, worker, group=self.layout.p2p))

    def _apply(self, grad: torch.Tensor) -> None:
        params = list(self.shard.values())
        for p, chunk in zip(params, grad.split([p.numel() for p in params])):
            p.grad = chunk.view_as(p)
        self.optimizer.step()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self._settle()
        return _gather_full(self.layout, self.device, self.server, self.shard.values())

    def _settle(self) -> None:
        # Called where every rank meets: every worker has its replies, so these complete.
        for work in self.sending:
            work.wait()
        self.sending = []

    def close(self) -> None:
        """The replies of the last step, received before the server leaves: gloo sends only
        once the worker has posted its receive, so a reply whose Work this rank dropped on
        its way out (while a loaded worker had not yet asked) never arrived, and the worker
        waited in its receive, the server in the group's closing barrier, until the timeout."""
        self._settle()

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Sends this server's shard to rank 0, a tensor at a time; {} here."""
        self._settle()
        for p in self.shard.values():
            collectives.isend(p.detach().contiguous(), 0).wait()
        return {}

    # A server writes its shard and its optimizer state under the plain model's names;
    # resumed with other servers, each reads the names it owns now. Versions and clocks
    # are not saved: a checkpoint is taken where every rank meets, all clocks equal and,
    # resumed, every replica starts from these values, so counting both again from 0 is
    # the same state.

    def checkpoint_parts(self, restoring: bool = False) -> dict:
        """This server's shard of the weights (a module of them under the plain model's
        names) and its optimizer."""
        self._settle()  # every reply sent: the shard is the one the workers were told
        return {"model": self.shard_module, "optimizer": self.optimizer}

    def epoch_metrics(self) -> dict[str, float]:
        out = {
            "ps_staleness_mean": self.stale_sum / max(self.pushes, 1),
            "ps_staleness_max": float(self.stale_max),
        }
        self.stale_sum = self.stale_max = self.pushes = 0
        return out
