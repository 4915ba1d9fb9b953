"""Pipeline parallel: the model's layers cut into stages, one stage per rank.

Each rank's batch is split into micro-batches that flow through the stages in the
order schedule.py gives (GPipe or 1F1B): activations go forward to the next stage,
their gradients come back. Every rank of one pipeline reads the same batch (stage 0
uses x, the last stage y); with dp > 1 the pipelines average their gradients.
Each micro-batch's mean loss is scaled by 1/m, so the summed gradient is that of the
mean loss over the batch: single-process SGD on it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from functools import cache
from itertools import accumulate
from statistics import fmean

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.errors import ConfigError

from .. import collectives
from ..config import TrainingConfig
from .base import OptimizerFactory, autocast_for, average_gradients, mesh_for
from .schedule import DeadlockError, actions, bubble_formula, dry_run, grid


def _parameters(layers) -> int:
    return sum(p.numel() for layer in layers for p in layer.parameters())


def balanced_bounds(sizes: list[int], stages: int) -> list[int]:
    """Cut points [0, b1, ..., len(sizes)] of the contiguous split of `sizes` into
    `stages` non-empty parts whose largest sum is smallest (the earliest cuts on ties)."""
    n, prefix = len(sizes), [0, *accumulate(sizes)]

    @cache
    def best(start: int, parts: int) -> tuple[int, tuple[int, ...]]:
        # (largest part, cuts) for sizes[start:] in `parts` parts
        if parts == 1:
            return prefix[n] - prefix[start], (n,)
        options = []
        for cut in range(start + 1, n - parts + 2):
            largest, cuts = best(cut, parts - 1)
            options.append((max(prefix[cut] - prefix[start], largest), (cut, *cuts)))
        return min(options, key=lambda o: o[0])

    return [0, *best(0, stages)[1]]


def stage_bounds(cfg: TrainingConfig, model: nn.Sequential, stages: int) -> list[int]:
    """[0, first layer of stage 1, ..., len(model)]: from the config, else balanced."""
    n = len(model)
    if cfg.pipeline_boundaries is None:
        return balanced_bounds([_parameters([layer]) for layer in model], stages)
    cuts = list(cfg.pipeline_boundaries)
    if len(cuts) != stages - 1:
        raise ConfigError(
            f"training.pipeline_boundaries {cuts}: {stages} pipeline stages need "
            f"{stages - 1} boundaries"
        )
    bounds = [0, *cuts, n]
    if any(lo >= hi for lo, hi in zip(bounds, bounds[1:])):
        raise ConfigError(
            f"training.pipeline_boundaries {cuts} must be increasing layer indices "
            f"from 1 to {n - 1} (the model has {n} layers)"
        )
    return bounds


class Pipeline:
    name = "pipeline"

    def check(self, cfg: TrainingConfig, model: nn.Sequential) -> None:
        mesh = mesh_for(cfg, "pp")
        if mesh.inner > len(model):
            raise ConfigError(
                f"training.pp {mesh.inner}: more pipeline stages than the model's {len(model)} layers"
            )
        stage_bounds(cfg, model, mesh.inner)
        if cfg.batch_size % mesh.dp:
            raise ConfigError(
                f"training.batch_size {cfg.batch_size} must be a multiple of training.dp {mesh.dp}"
            )
        local = cfg.batch_size // mesh.dp
        if local % cfg.micro_batches:
            raise ConfigError(
                f"training.micro_batches {cfg.micro_batches} must divide each pipeline's batch "
                f"of {local} rows (training.batch_size {cfg.batch_size} / training.dp {mesh.dp})"
            )
        try:
            dry_run(cfg.pipeline_schedule, mesh.inner, cfg.micro_batches)
        except DeadlockError as e:
            raise ConfigError(
                f"training.pipeline_schedule {cfg.pipeline_schedule} deadlocks with "
                f"training.pp {mesh.inner}, training.micro_batches {cfg.micro_batches}: {e}"
            ) from None

    def data_world(self, cfg: TrainingConfig) -> int:
        return mesh_for(cfg, "pp").dp

    def describe(self, cfg: TrainingConfig, model: nn.Sequential) -> str:
        """Stages, the schedule's grid and its bubble: printed on the driver at start."""
        mesh = mesh_for(cfg, "pp")
        p, m = mesh.inner, cfg.micro_batches
        bounds = stage_bounds(cfg, model, p)
        lines = [
            f"pipeline: {p} stages x dp {mesh.dp}, {cfg.pipeline_schedule}, {m} micro-batches "
            f"of {cfg.batch_size // mesh.dp // m} rows"
        ]
        for s in range(p):
            layers = [model[i] for i in range(bounds[s], bounds[s + 1])]
            names = ", ".join(type(layer).__name__ for layer in layers)
            # rank = dp_index * pp + stage: which ranks run this row of the grid.
            ranks = ", ".join(str(d * p + s) for d in range(mesh.dp))
            lines.append(
                f"  stage {s} (rank{'s' if mesh.dp > 1 else ''} {ranks}): layers "
                f"{bounds[s]}-{bounds[s + 1] - 1} ({names}), {_parameters(layers):,} parameters"
            )
        lines += ["  " + row for row in grid(dry_run(cfg.pipeline_schedule, p, m)).splitlines()]
        lines.append(f"  bubble (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {bubble_formula(p, m):.1%}")
        return "\n".join(lines)

    def setup(
        self, model: nn.Sequential, cfg: TrainingConfig, rank: int, world_size: int,
        device: torch.device, make_optimizer: OptimizerFactory,
    ) -> PipelineRank:
        return PipelineRank(model, cfg, rank, device, make_optimizer)


class PipelineRank:
    def __init__(self, model, cfg, rank, device, make_optimizer):
        mesh = mesh_for(cfg, "pp")
        self.stages, stage = mesh.inner, mesh.inner_index(rank)
        self.dp = mesh.dp
        self.dp_group, self.pp_group = mesh.groups(rank)
        self.first, self.last = stage == 0, stage == self.stages - 1
        # rank = dp_index * pp + stage: the neighbouring stages are the neighbouring ranks.
        self.prev, self.next = rank - 1, rank + 1
        bounds = stage_bounds(cfg, model, self.stages)
        self.lo, self.hi = bounds[stage], bounds[stage + 1]
        # The model's own children under their own indices: state keys stay the plain
        # model's ("3.linear.weight"), so the stages' state dicts merge into it.
        self.layers = nn.Sequential(OrderedDict((str(i), model[i]) for i in range(self.lo, self.hi)))
        # Kept only until the first step measures the activation shapes (_probe).
        self.model = model
        self.in_shape = self.out_shape = None
        self.micro_batches = cfg.micro_batches
        self.actions = actions(cfg.pipeline_schedule, self.stages, cfg.micro_batches, stage)
        params = list(self.layers.parameters())
        # A stage of parameterless layers (a reshape) has nothing to optimise.
        self.optimizer = make_optimizer(params) if params else None
        self.autocast = autocast_for(device, cfg)
        self.device = device
        self.data_rank, self.data_world, self.reports = mesh.dp_index(rank), mesh.dp, self.last
        self.bubble_formula = bubble_formula(self.stages, cfg.micro_batches)
        self.bubbles: list[float] = []

    def _probe(self, x: torch.Tensor) -> None:
        """The shapes (less the batch dimension) of the activations entering and leaving
        this stage, from one sample through the whole model. Done at the first step, not
        at setup: only the data knows the input's width, and every stage has x, so no
        stage waits for another. eval + no_grad: the probe changes no state."""
        self.model.eval()
        with torch.no_grad():
            h, shapes = x[:1], [x.shape[1:]]
            for layer in self.model:
                h = layer(h)
                shapes.append(h.shape[1:])
        self.in_shape, self.out_shape = shapes[self.lo], shapes[self.hi]
        self.model = None  # drop the other stages' layers

    def _recv(self, shape, rows: int, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty((rows, *shape), device=self.device)
        collectives.recv(buf, src, tag=tag)
        return buf

    def step(self, x, y):
        if self.model is not None:
            self._probe(x)
        self.layers.train()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        m = self.micro_batches
        xs, ys = x.chunk(m), y.chunk(m)
        rows = len(xs[0])
        # Tags: 2i for micro-batch i's activation, 2i+1 for its gradient.
        inputs, outputs, sent, logits, losses = {}, {}, [], [], []
        busy, start = 0.0, time.perf_counter()
        for kind, i in self.actions:
            if kind == "F":
                if self.first:
                    inp = xs[i]
                else:
                    inp = self._recv(self.in_shape, rows, self.prev, 2 * i).requires_grad_()
                t = time.perf_counter()
                with self.autocast:
                    out = self.layers(inp)
                    if self.last:
                        logits.append(out.detach())
                        out = F.cross_entropy(out, ys[i]) / m
                        losses.append(out.detach())
                busy += time.perf_counter() - t
                if not self.last:
                    # float32 on the wire: under autocast the output may be bf16.
                    act = out.detach().float().contiguous()
                    sent.append((collectives.isend(act, self.next, tag=2 * i), act))
                inputs[i], outputs[i] = inp, out
            else:
                grad = None if self.last else self._recv(self.out_shape, rows, self.next, 2 * i + 1)
                out = outputs.pop(i)
                t = time.perf_counter()
                out.backward(None if self.last else grad.to(out.dtype))
                busy += time.perf_counter() - t
                inp = inputs.pop(i)
                if not self.first:
                    sent.append((collectives.isend(inp.grad, self.prev, tag=2 * i + 1), inp.grad))
        # The sent tensors stay referenced until their sends complete.
        for work, _ in sent:
            work.wait()
        # The schedule's wall time: the all-reduce and optimizer step are no pipeline bubble.
        self.bubbles.append(1 - busy / (time.perf_counter() - start))
        average_gradients(list(self.layers.parameters()), self.dp_group, self.dp)
        if self.optimizer is not None:
            self.optimizer.step()
        if self.last:
            return torch.cat(logits), torch.stack(losses).sum()
        return None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        own = {k: v.detach().cpu() for k, v in self.layers.state_dict().items()}
        if self.pp_group is None:
            return own
        parts = collectives.all_gather_object(own, group=self.pp_group)
        return {k: v for part in parts for k, v in part.items()}

    def state_dict(self) -> dict:
        # The stage's weights are in the checkpoint's full "model".
        return {"optimizer": self.optimizer.state_dict() if self.optimizer else {}}

    def load_state_dict(self, state: dict, full: dict[str, torch.Tensor]) -> None:
        self.layers.load_state_dict({k: full[k] for k in self.layers.state_dict()})
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def epoch_metrics(self) -> dict[str, float]:
        bubbles, self.bubbles = self.bubbles, []
        metrics = {"pipeline_bubble_formula": self.bubble_formula}
        if bubbles:
            metrics["pipeline_bubble"] = fmean(bubbles)
        return metrics
