"""Pipeline parallel on torch.distributed.pipelining: the model's layers cut into stages,
each a `PipelineStage`, run by one of torch's schedules (schedule.py). The mesh's pp
dimension; each stage is then split and sharded over the rank's tp and data dimensions like
any model (parallelize.py): a stage is just a part of it.

The model's layers (training.models.plans.pipeline_layers: an nn.Sequential's children,
or the children its `pipeline_layers()` names, in forward order) are cut at stage bounds
(from the config, else balanced by parameter count) into p x v stages: v per rank of a
pipeline of p ranks, placed as the schedule wants them (the rank at pp index r holds stage r
for GPipe and 1F1B, r, r+p, ... for interleaved 1F1B, r and 2p-1-r for ZBV). Every rank of
one pipeline reads the same batch (the first stage uses x, the last y); the data dimensions'
pipelines average their gradients through FSDP2 (parallelize.apply_data_parallel).
Named inputs (a dataset with tensor or image columns) reach the first stage as positional
tensors, in the batch's order, and its first layer as keyword arguments
(`layer(image=..., tokens=...)`, training.batch.as_kwargs): torch's schedules give
keyword arguments to every stage of a rank, positional ones to the first stage only.
torch's schedule takes each micro-batch's mean loss and divides the summed gradients by
the number of micro-batches: the gradient of the batch's mean loss, as single-process
training computes it.
"""

from __future__ import annotations

from collections import OrderedDict
from statistics import fmean

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from .. import collectives
from ..batch import as_args, as_kwargs, names
from ..config import TrainingConfig
from ..task import loss_for
from .base import BatchSums, ModelBuilder, OptimizerFactory, Parallel
from .parallelize import Plans, materialise, parallelize, plain_replicas, shape_of
from .pipeline_stages import model_layers, pipeline_layout, stage_bounds
from .pipeline_timing import RankClock, StepLog, TimedStage, step_bubbles
from .precision import Precision
from .schedule import SCHEDULES, closed_form, schedule_bubble

# Full (unsharded) tensors on every rank of a stage: the plain evaluation model's.
_FULL = StateDictOptions(full_state_dict=True)


class StageLayers(nn.Sequential):
    """Layers lo..hi-1 of the model, under their own names (so state keys stay the plain
    model's, "3.linear.weight", and the plans' module paths reach into it), run under the
    job's autocast. The output leaves as float32: the next stage or the loss gets what
    single-process autocast would give it, and the wire and the gradient coming back are
    float32.

    The first stage of a model with named inputs is given them positionally; `input_names`
    (set by PipelineRank.step from the batch) turns them back into its first layer's
    keyword arguments. Integer inputs pass autocast unchanged (it casts floating operands)."""

    def __init__(self, layers: list[tuple[str, nn.Module]], lo: int, hi: int, precision: Precision):
        super().__init__(OrderedDict(layers[lo:hi]))
        self.precision = precision
        self.input_names: list[str] | None = None  # named inputs of the model's first layer

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast(args[0].device):
            layers = iter(self)
            if self.input_names is not None:
                out = next(layers)(**as_kwargs(self.input_names, args))
            else:
                (out,) = args
            for layer in layers:
                out = layer(out)
        return out.float()


def average_gradients(params: list[nn.Parameter], group, degree: int) -> None:
    """The mean of each gradient over a data-parallel group, in one flat all-reduce: with
    equal local batches, the mean of the replicas' mean-loss gradients is the global one."""
    if group is None or not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    collectives.all_reduce(flat, group=group)
    flat /= degree
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)


def held_layers(parts: list[nn.Module]) -> nn.Module:
    """One module whose children are every layer of `parts` (this rank's stages), under the
    plain model's names: its state dict is what the rank holds, keyed as the plain model's."""
    held = nn.Module()
    for part in parts:
        for name, layer in part.named_children():
            held.add_module(name, layer)
    return held


class PipelineRank(Parallel):
    def __init__(self, model: nn.Module, cfg: TrainingConfig, rank: int, device: torch.device,
                 make_optimizer: OptimizerFactory, mesh: DeviceMesh, plans: Plans, build: ModelBuilder | None):
        """`model`: the plain model, on `device`, or on the meta device when `build` is given
        (the rank then gets its layers' values from rank 0's build: parallelize.materialise)."""
        shape = shape_of(mesh)
        settings = cfg.pipeline
        self.pp_group = mesh["pp"].get_group()
        self.layout = lay = pipeline_layout(settings, shape.pp)
        self.loss = loss_for(cfg)
        self.pp_rank = shape.coordinates(rank)["pp"]  # position in the pipeline
        precision = Precision.of(cfg)
        layers = model_layers(cfg, model)
        bounds = stage_bounds(settings, layers, lay.stages)
        # Timing is opt-in (training.pipeline.timing): it synchronises the device around
        # every action, which a GPU run cannot afford; the plain stage keeps the overlap.
        self.clock = RankClock(device) if settings.timing else None
        # Export: every weight's name, shape and dtype in the plain model's order, and the
        # pipeline position holding it (rank 0 receives them one by one from there).
        self.exported = [
            (f"{name}.{k}", v.shape, v.dtype, lay.stage_rank[s])
            for s in range(lay.stages) for name, layer in layers[bounds[s]:bounds[s + 1]]
            for k, v in layer.state_dict().items()
        ]
        parts = [StageLayers(layers, bounds[s], bounds[s + 1], precision) for s in lay.rank_stages(self.pp_rank)]
        if build is None:
            for part in parts:
                part.to(device)
        for part in parts:  # tensor parallel, recompute, FSDP over the data dimensions: in place
            parallelize(part, mesh, plans, precision)
        self.held_module = held_layers(parts)
        if build is not None:
            materialise(self.held_module, model, build, rank, device)

        def stage(s: int, part: StageLayers) -> PipelineStage:
            if self.clock is None:
                return PipelineStage(part, s, lay.stages, device, group=self.pp_group)
            return TimedStage(part, s, lay.stages, device, group=self.pp_group, clock=self.clock)

        self.stages = [stage(s, part) for s, part in zip(lay.rank_stages(self.pp_rank), parts)]
        self.params = list(self.held_module.parameters())
        # A rank of parameterless layers (a reshape) has nothing to optimise.
        self.optimizer = make_optimizer(self.params) if self.params else None
        single = lay.stages_per_rank == 1
        self.schedule = SCHEDULES[lay.name].torch_class(
            self.stages[0] if single else self.stages, lay.micro_batches, loss_fn=self._loss
        )
        self.device, self.rank, self.shape = device, rank, shape
        # Replicas of plain stages average their gradients after the step (parallelize.py).
        self.dp_group = mesh["dp_replicate"].get_group() if plain_replicas(shape) and shape.data_world > 1 else None
        self.first = any(stage.is_first for stage in self.stages)
        self.last = any(stage.is_last for stage in self.stages)
        self.data_rank, self.data_world, self.reports = shape.data_rank(rank), shape.data_world, shape.reports(rank)
        formula = closed_form(lay)  # exact where a formula exists; else the replay's
        self.bubble_formula = formula[1] / formula[2] if formula else schedule_bubble(lay)
        self.steps_run = 0
        # The step's outputs (or their sums: step_sums) while it runs, where this rank returns them (_keep).
        self.keeping, self.parts = False, []
        self.summing: BatchSums | None = None
        self.step_total: torch.Tensor | None = None

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.loss(logits, y)
        if self.keeping:
            self._keep(logits.detach(), y, loss.detach())
        if self.clock is not None:
            self.clock.extend_last_forward()
        return loss

    def _keep(self, logits: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> None:
        """A micro-batch's outputs for the step's return, or (step_sums) only their sums."""
        if self.summing is not None:
            self.parts.append(self.summing(logits, y, loss))
        else:
            self.parts.append(logits)

    def step_sums(self, x, y, sums: BatchSums):
        """The batch's sums added up a micro-batch at a time, and no outputs kept: the last
        stage would otherwise hold the whole batch's logits through the step (torch's
        return_outputs keeps each micro-batch's, then concatenates them), its largest extra
        over an FSDP rank (a quarter of the batch each) on a wide vocabulary (`shardline bench
        sharding`). Per micro-batch, a batch with pads counts each one's mean loss by its own
        tokens."""
        self.summing = sums
        try:
            out = self.step(x, y)
        finally:
            self.summing = None
        return out, self.step_total

    def step(self, x, y):
        for stage in self.stages:
            stage.submod.train()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.clock is not None:
            # Timed, the pipeline's ranks start the step together: its span is then the
            # longest rank's time in it (pipeline_timing.py).
            collectives.barrier(group=self.pp_group)
            self.clock.begin(first=self.steps_run == 0)
        if self.first:
            for stage in self.stages:
                if stage.is_first:
                    stage.submod.input_names = names(x)
        args = as_args(x) if self.first else ()
        losses: list[torch.Tensor] = []  # each micro-batch's mean loss, on the last stage
        # Outputs kept only where returned (the last stage's reporting rank); the last len(losses) of
        # them are the micro-batches' (the first step calls the loss once more before them, on
        # a forward of its own, to infer the backward's shapes).
        self.keeping, self.parts = self.last and self.reports, []
        self.schedule.step(*args, target=y if self.last else None, losses=losses, return_outputs=False)
        parts = self.parts[-len(losses):] if self.keeping else []
        self.keeping, self.parts = False, []
        logits = self.step_total = None
        if parts and self.summing is not None:
            self.step_total = torch.stack(parts).sum(0)
        elif parts:
            logits = torch.cat(parts)
        if self.clock is not None:
            self.clock.end()
        self.steps_run += 1
        # Replicated pipelines average their gradients: no pipeline bubble, outside the step;
        # sharded ones did inside it (FSDP2's reduce-scatter).
        average_gradients(self.params, self.dp_group, self.shape.data_world)
        if self.optimizer is not None:
            self.optimizer.step()
        if self.last and self.reports:
            return logits, torch.stack(losses).detach().mean()
        return None

    def checkpoint_parts(self, restoring: bool = False) -> dict:
        """This rank's stages' layers, under the plain model's names, and their optimizer."""
        return {"model": self.held_module, **({"optimizer": self.optimizer} if self.optimizer else {})}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's weights on every rank: each stage's gathered over its own
        data and tp ranks, then the stages over the pipeline's. Collective."""
        # (torch's state-dict API refuses a module with no state: a stage of parameterless layers.)
        state = get_model_state_dict(self.held_module, options=_FULL) if self.held_module.state_dict() else {}
        own = {k: v.detach().cpu() for k, v in state.items()}
        parts = collectives.all_gather_object(own, group=self.pp_group)
        merged = {k: v for part in parts for k, v in part.items()}
        return {key: merged[key] for key, *_ in self.exported}

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0 receives the plain model's weights a tensor at a time, in the plain model's
        order: each made whole by the ranks of its stage (a DTensor's gather over their data
        and tp dimensions), sent by the first of them; rank 0 copies its own. Collective."""
        mine, out = self.held_module.state_dict(), {}
        me = self.shape.coordinates(self.rank)
        sends = me["dp_replicate"] == me["dp_shard"] == me["tp"] == 0  # the first rank of its stage
        for key, shape, dtype, position in self.exported:
            if position == self.pp_rank:
                t = mine[key]
                whole = t.full_tensor() if isinstance(t, DTensor) else t.detach()
                if self.rank == 0:
                    out[key] = whole.cpu()
                elif sends:
                    collectives.isend(whole.contiguous(), 0).wait()
            elif self.rank == 0:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                collectives.recv(t, self.shape.rank_at(pp=position))
                out[key] = t.cpu()
        return out

    def gathered_steps(self) -> list[list[StepLog]]:
        """Every rank of this pipeline's step logs since the last call, logs[rank][step].
        Collective over the pipeline's group. The schedule's first step also measured
        shapes and connected the stages: it is left out."""
        if self.clock is None:
            return []
        mine = [log for log in self.clock.take() if not log.first]
        return collectives.all_gather_object(mine, group=self.pp_group)

    def epoch_metrics(self) -> dict[str, float]:
        """Collective over the pipeline's group (every rank calls it at an epoch's end)."""
        metrics = {"pipeline_bubble_formula": self.bubble_formula}
        if self.clock is None:
            return metrics
        logs = self.gathered_steps()
        me = self.pp_rank
        bubbles = step_bubbles(self.layout, logs)
        if bubbles:
            metrics["pipeline_bubble"] = fmean(b.measured[me] for b in bubbles)
            metrics["pipeline_bubble_predicted"] = fmean(b.predicted[me] for b in bubbles)
            metrics["pipeline_cpu_wait"] = fmean(b.cpu_wait[me] for b in bubbles)
            # Most micro-batches whose activations this rank held at once.
            metrics["pipeline_activations_held_max"] = float(max(log.held_in_all for log in logs[me]))
        return metrics
