"""Pipeline parallel on torch.distributed.pipelining: the model's layers cut into stages,
each a `PipelineStage`, run by one of torch's schedules (schedule.py).

The model's layers (training.models.plans.pipeline_layers: an nn.Sequential's children,
or the children its `pipeline_layers()` names, in forward order) are cut at stage bounds (from the config, else balanced by
parameter count) into p x v stages: v per rank of a pipeline of p ranks, placed as the
schedule wants them (rank r holds stage r for GPipe and 1F1B, r, r+p, ... for
interleaved 1F1B, r and 2p-1-r for ZBV). Every rank of one pipeline reads the same batch
(the first stage uses x, the last y); with dp > 1 the pipelines average their gradients.
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
from functools import cache
from itertools import accumulate
from statistics import fmean

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from shardline.foundation.errors import ConfigError, first_line

from .. import collectives
from ..checkpoints.named import NamedOptimizer, NamedTensors, optimizer_names
from ..batch import as_args, as_kwargs, forward, names
from ..config import TrainingConfig
from ..models.factory import factory_path
from ..models.inputs import ModelInputs
from ..models.plans import pipeline_layers
from ..task import loss_for
from ..strategy_settings import PipelineSettings
from .base import Mesh, OptimizerFactory, Parallel, Strategy, average_gradients, mesh_for
from .pipeline_timing import RankClock, StepLog, TimedStage, step_bubbles
from .schedule import SCHEDULES, Layout, ReplayStuck, closed_form, grid, in_flight, layout, schedule_bubble


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


def model_layers(cfg: TrainingConfig, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in forward order, (name, module); one line if it declares none."""
    layers = pipeline_layers(model, f"training.model {cfg.model}")
    if layers is None:
        raise ConfigError(
            f"training.strategy pipeline: training.model {cfg.model} is no nn.Sequential and declares no "
            "pipeline_layers() (the names of its child modules, in the order its forward runs them)"
        )
    return layers


def stage_bounds(settings: PipelineSettings, layers: list[tuple[str, nn.Module]], stages: int) -> list[int]:
    """[0, first layer of stage 1, ..., len(layers)]: from the settings, else balanced."""
    n = len(layers)
    if settings.boundaries is None:
        return balanced_bounds([_parameters([layer]) for _, layer in layers], stages)
    cuts = list(settings.boundaries)
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


def stages_per_rank(settings: PipelineSettings) -> int:
    fixed = SCHEDULES[settings.schedule].stages_per_rank
    v = settings.stages_per_rank or fixed or 2
    if (fixed is not None and v != fixed) or v < 1 or (fixed is None and v < 2):
        need = f"exactly {fixed}" if fixed else "2 or more"
        raise ConfigError(
            f"training.pipeline_stages_per_rank {v}: training.pipeline_schedule "
            f"{settings.schedule} runs {need} stages per rank"
        )
    return v


class Pipeline(Strategy):
    name = "pipeline"
    settings: PipelineSettings
    mesh: Mesh

    def __init__(self, cfg: TrainingConfig):
        mesh = mesh_for(cfg, "pp")
        # Every rank of one pipeline reads the same batch: each pipeline is one data part.
        super().__init__(cfg.pipeline, mesh, mesh.dp)

    def layout(self) -> Layout:
        """The schedule these settings run, or ConfigError naming the settings torch refuses."""
        p, m, v = self.mesh.inner, self.settings.micro_batches, stages_per_rank(self.settings)
        schedule = self.settings.schedule
        try:
            lay = layout(schedule, p, v, m)
            schedule_bubble(lay)  # every action can run: no rank waits forever
        except (ValueError, ReplayStuck) as e:
            raise ConfigError(
                f"training.pipeline_schedule {schedule} with training.pp {p}, "
                f"training.micro_batches {m}, {v} stage(s) per rank: {e}"
            ) from None
        return lay

    def check(self, cfg: TrainingConfig, model: nn.Module, inputs: ModelInputs | None = None) -> None:
        mesh = self.mesh
        if mesh.inner < 2:
            raise ConfigError(
                f"training.pp {mesh.inner}: a pipeline needs at least 2 ranks (one model "
                "replica per rank is strategy ddp)"
            )
        v = stages_per_rank(self.settings)
        layers = model_layers(cfg, model)
        if mesh.inner * v > len(layers):
            split = f"training.pp {mesh.inner}" + (
                f" x training.pipeline_stages_per_rank {v}" if v > 1 else ""
            )
            raise ConfigError(f"{split}: more pipeline stages than the model's {len(layers)} layers")
        stage_bounds(self.settings, layers, mesh.inner * v)
        if cfg.batch_size % mesh.dp:
            raise ConfigError(
                f"training.batch_size {cfg.batch_size} must be a multiple of training.dp {mesh.dp}"
            )
        local = cfg.batch_size // mesh.dp
        m = self.settings.micro_batches
        if local % m:
            raise ConfigError(
                f"training.micro_batches {m} must divide each pipeline's batch "
                f"of {local} rows (training.batch_size {cfg.batch_size} / training.dp {mesh.dp})"
            )
        self.layout()
        if inputs is not None and not isinstance(model, nn.Sequential):
            _check_layers_compose(cfg, model, layers, inputs)

    def describe(self, cfg: TrainingConfig, model: nn.Module) -> str:
        """Stages, the schedule's grid and its bubble: printed on the driver at start."""
        mesh, lay, schedule = self.mesh, self.layout(), self.settings.schedule
        p, m = mesh.inner, self.settings.micro_batches
        all_layers = model_layers(cfg, model)
        bounds = stage_bounds(self.settings, all_layers, lay.stages)
        lines = [
            f"pipeline: {p} ranks x dp {mesh.dp}, {schedule} "
            f"({SCHEDULES[schedule].summary}), {lay.stages} stages, {m} micro-batches "
            f"of {cfg.batch_size // mesh.dp // m} rows"
        ]
        # rank = dp_index * pp + position in the pipeline: the ranks at each position.
        at = [", ".join(str(d * p + r) for d in range(mesh.dp)) for r in range(p)]
        for s in range(lay.stages):
            lo, hi = bounds[s], bounds[s + 1] - 1
            layers = [all_layers[i][1] for i in range(lo, hi + 1)]
            names = ", ".join(type(layer).__name__ for layer in layers)
            lines.append(
                f"  stage {s} (rank{'s' if mesh.dp > 1 else ''} {at[lay.stage_rank[s]]}): "
                f"{f'layers {lo}-{hi}' if hi > lo else f'layer {lo}'} ({names}), "
                f"{_parameters(layers):,} parameters"
            )
        lines.append(
            "  schedule (torch's action order; one column per time unit with equal stages: "
            "F 1, B 2, I 1, W 1; '.' idle):"
        )
        rows = [f"rank{'s' if mesh.dp > 1 else ''} {ranks}" for ranks in at]
        lines += ["    " + row for row in grid(lay, rows).splitlines()]
        formula = closed_form(lay)
        if formula:
            expression, num, den = formula
            lines.append(f"  bubble {expression} = {num}/{den} = {num / den:.1%}")
        else:
            lines.append(f"  bubble of this grid = {schedule_bubble(lay):.1%}")
        held = ", ".join(f"stage {s} {n}" for s, n in in_flight(lay).items())
        lines.append(f"  micro-batches whose activations a stage holds at most: {held}")
        return "\n".join(lines)

    def setup(
        self, model: nn.Module, cfg: TrainingConfig, rank: int, world_size: int,
        device: torch.device, make_optimizer: OptimizerFactory,
    ) -> PipelineRank:
        return PipelineRank(self, model, cfg, rank, device, make_optimizer)


def _check_layers_compose(cfg: TrainingConfig, model: nn.Module, layers: list[tuple[str, nn.Module]],
                          inputs: ModelInputs) -> None:
    """A pipeline runs the model's pipeline_layers() one after the other: that must be its
    forward (the first layer takes the named inputs as keywords, as the model does), tried on
    a sample batch of the dataset's shape. An nn.Sequential's forward is that by definition."""
    what = f"training.model {factory_path(cfg)}"
    x, _ = inputs.sample_batch(2)
    model.eval()  # no dropout: the two runs must agree
    with torch.no_grad():
        out = forward(model, x)  # check_model ran it already: a failure here is not the layers'
    why = ""
    try:
        with torch.no_grad():
            h = forward(layers[0][1], x)
            for _, layer in layers[1:]:
                h = layer(h)
        same = isinstance(h, torch.Tensor) and h.shape == out.shape and torch.allclose(h, out, atol=1e-5)
    except Exception as e:  # noqa: BLE001 - layers that do not chain: the same mistake
        same, why = False, f" ({first_line(e, with_type=True)})"
    if not same:
        raise ConfigError(
            f"{what}: its pipeline_layers() run one after the other do not give its forward's output "
            f"(a pipeline would train another model){why}"
        )


class StageLayers(nn.Sequential):
    """Layers lo..hi-1 of the model, under their own names (so state keys stay the plain
    model's, "3.linear.weight"), run under bf16 autocast when configured. The output leaves
    as float32: the next stage or the loss gets what single-process autocast would give it,
    and the wire and the gradient coming back are float32.

    The first stage of a model with named inputs is given them positionally; `input_names`
    (set by PipelineRank.step from the batch) turns them back into its first layer's
    keyword arguments. Integer inputs pass autocast unchanged (it casts floating operands)."""

    def __init__(self, layers: list[tuple[str, nn.Module]], lo: int, hi: int, bf16: bool):
        super().__init__(OrderedDict(layers[lo:hi]))
        self.bf16 = bf16
        self.input_names: list[str] | None = None  # named inputs of the model's first layer

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        with torch.autocast(args[0].device.type, dtype=torch.bfloat16, enabled=self.bf16):
            layers = iter(self)
            if self.input_names is not None:
                out = next(layers)(**as_kwargs(self.input_names, args))
            else:
                (out,) = args
            for layer in layers:
                out = layer(out)
        return out.float()


class PipelineRank(Parallel):
    def __init__(self, strategy: Pipeline, model, cfg, rank, device, make_optimizer):
        mesh = strategy.mesh
        self.dp = mesh.dp
        self.dp_group, self.pp_group = mesh.groups(rank)
        self.layout = lay = strategy.layout()
        self.loss = loss_for(cfg)
        self.pp_rank = mesh.inner_index(rank)  # position in the pipeline
        layers = model_layers(cfg, model)
        bounds = stage_bounds(strategy.settings, layers, lay.stages)
        # Timing is opt-in (training.pipeline.timing): it synchronises the device around
        # every action, which a GPU run cannot afford; the plain stage keeps the overlap.
        self.clock = RankClock(device) if strategy.settings.timing else None

        def stage(s: int) -> PipelineStage:
            part = StageLayers(layers, bounds[s], bounds[s + 1], cfg.precision == "bf16").to(device)
            if self.clock is None:
                return PipelineStage(part, s, lay.stages, device, group=self.pp_group)
            return TimedStage(part, s, lay.stages, device, group=self.pp_group, clock=self.clock)

        self.stages = [stage(s) for s in lay.rank_stages(self.pp_rank)]
        self.params = [p for stage in self.stages for p in stage.submod.parameters()]
        # A rank of parameterless layers (a reshape) has nothing to optimise.
        self.optimizer = make_optimizer(self.params) if self.params else None
        single = lay.stages_per_rank == 1
        self.schedule = SCHEDULES[lay.name].torch_class(
            self.stages[0] if single else self.stages, lay.micro_batches, loss_fn=self._loss
        )
        self.names = (optimizer_names(self._named_parameters(), self.optimizer)
                      if self.optimizer else [])
        # Export: every weight's name, shape and dtype, in the plain model's order, and the
        # rank of the first pipeline replica holding it (rank 0 receives them one by one).
        self.device, self.rank = device, rank
        self.exported = [
            (f"{name}.{k}", v.shape, v.dtype, lay.stage_rank[s])
            for s in range(lay.stages) for name, layer in layers[bounds[s]:bounds[s + 1]]
            for k, v in layer.state_dict().items()
        ]
        self.first = any(stage.is_first for stage in self.stages)
        self.last = any(stage.is_last for stage in self.stages)
        self.data_rank, self.data_world, self.reports = mesh.dp_index(rank), mesh.dp, self.last
        formula = closed_form(lay)  # exact where a formula exists; else the replay's
        self.bubble_formula = formula[1] / formula[2] if formula else schedule_bubble(lay)
        self.steps_run = 0

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.loss(logits, y)
        if self.clock is not None:
            self.clock.extend_last_forward()
        return loss

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
        logits = self.schedule.step(*args, target=y if self.last else None, losses=losses)
        if self.clock is not None:
            self.clock.end()
        self.steps_run += 1
        # The replicas' pipelines average their gradients: no pipeline bubble, outside the step.
        average_gradients(self.params, self.dp_group, self.dp)
        if self.optimizer is not None:
            self.optimizer.step()
        if self.last:
            return logits.detach(), torch.stack(losses).detach().mean()
        return None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        own = [
            (stage.stage_index, {k: v.detach().cpu() for k, v in stage.submod.state_dict().items()})
            for stage in self.stages
        ]
        parts = collectives.all_gather_object(own, group=self.pp_group)
        # In stage order, as the plain model's state dict is (a rank may hold stages 0 and 3).
        stages = sorted((s for part in parts for s in part), key=lambda s: s[0])
        return {k: v for _, state in stages for k, v in state.items()}

    def _named_parameters(self):
        return [(n, p) for stage in self.stages for n, p in stage.submod.named_parameters()]

    def _weights(self) -> dict[str, torch.Tensor]:
        """This rank's stages' weights under the plain model's names (StageLayers keeps them)."""
        return {k: v for stage in self.stages for k, v in stage.submod.state_dict().items()}

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0 receives the first pipeline's weights a tensor at a time, in the plain
        model's order, from the rank of each stage (its own it copies)."""
        if self.data_rank != 0:  # another replica: rank 0 takes the first one's
            return {}
        mine, out = self._weights(), {}
        for key, shape, dtype, holder in self.exported:
            if holder == self.rank == 0:
                out[key] = mine[key].detach().cpu()
            elif self.rank == 0:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                collectives.recv(t, holder)
                out[key] = t.cpu()
            elif holder == self.rank:
                collectives.isend(mine[key].detach().contiguous(), 0).wait()
        return out

    # Each rank writes its stages' weights and optimizer state under the plain model's
    # names, and reads those of the stages it holds now: another pp or other stage bounds
    # read other names, so a pipeline checkpoint reshards like any other.

    def checkpoint_parts(self, restoring: bool = False) -> dict[str, object]:
        """This rank's stages' weights and optimizer state, by the plain model's names."""
        parts: dict[str, object] = {"model": NamedTensors(self._weights())}
        if self.optimizer is not None:
            parts["optimizer"] = NamedOptimizer(self.optimizer, self.names)
        return parts

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
