"""How a pipeline cuts the model into stages, checked and described on the driver before
any process starts: the model's layers, the stage bounds (from the config, else balanced by
parameter count), the schedule's layout (schedule.py), and the refusals, each one line naming
the setting. pipeline.py runs the stages on the ranks."""

from __future__ import annotations

from functools import cache
from itertools import accumulate

import torch
from torch import nn

from shardline.foundation.errors import ConfigError, first_line

from ..batch import forward
from ..config import TrainingConfig
from ..mesh_shape import MeshShape
from ..models.factory import factory_path
from ..models.inputs import ModelInputs
from ..models.plans import pipeline_layers
from ..strategy_settings import PipelineSettings
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
            f"training.mesh.pp (a pipeline): training.model {cfg.model} is no nn.Sequential and declares no "
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
            f"training.pipeline.boundaries {cuts}: {stages} pipeline stages need "
            f"{stages - 1} boundaries"
        )
    bounds = [0, *cuts, n]
    if any(lo >= hi for lo, hi in zip(bounds, bounds[1:])):
        raise ConfigError(
            f"training.pipeline.boundaries {cuts} must be increasing layer indices "
            f"from 1 to {n - 1} (the model has {n} layers)"
        )
    return bounds


def stages_per_rank(settings: PipelineSettings) -> int:
    fixed = SCHEDULES[settings.schedule].stages_per_rank
    v = settings.stages_per_rank or fixed or 2
    if (fixed is not None and v != fixed) or v < 1 or (fixed is None and v < 2):
        need = f"exactly {fixed}" if fixed else "2 or more"
        raise ConfigError(
            f"training.pipeline.stages_per_rank {v}: training.pipeline.schedule "
            f"{settings.schedule} runs {need} stages per rank"
        )
    return v


def pipeline_layout(settings: PipelineSettings, pp: int) -> Layout:
    """The schedule these settings run on `pp` ranks, or ConfigError naming the settings torch refuses."""
    m, v = settings.micro_batches, stages_per_rank(settings)
    try:
        lay = layout(settings.schedule, pp, v, m)
        schedule_bubble(lay)  # every action can run: no rank waits forever
    except (ValueError, ReplayStuck) as e:
        raise ConfigError(
            f"training.pipeline.schedule {settings.schedule} with training.mesh.pp {pp}, "
            f"training.pipeline.micro_batches {m}, {v} stage(s) per rank: {e}"
        ) from None
    return lay


def check_pipeline(cfg: TrainingConfig, shape: MeshShape, model: nn.Module, inputs: ModelInputs | None) -> None:
    """Refuse, in one line naming the setting, a pipeline this model and mesh cannot run."""
    settings, pp = cfg.pipeline, shape.pp
    v = stages_per_rank(settings)
    layers = model_layers(cfg, model)
    if pp * v > len(layers):
        split = f"training.mesh.pp {pp}" + (f" x training.pipeline.stages_per_rank {v}" if v > 1 else "")
        raise ConfigError(f"{split}: more pipeline stages than the model's {len(layers)} layers")
    stage_bounds(settings, layers, pp * v)
    local = cfg.batch_size // shape.data_world
    if local % settings.micro_batches:
        raise ConfigError(
            f"training.pipeline.micro_batches {settings.micro_batches} must divide each pipeline's batch "
            f"of {local} rows (training.batch_size {cfg.batch_size} / {shape.data_world} data-parallel ranks)"
        )
    pipeline_layout(settings, pp)
    if settings.schedule == "zbv" and not (shape.dp_shard == 1 and shape.tp == 1) and shape.data_world > 1:
        raise ConfigError(
            f"training.pipeline.schedule zbv with sharded data-parallel pipelines (training.mesh {shape.named()}): "
            "FSDP2 reduces gradients before zero-bubble's deferred weight gradients (torch 2.13, measured 7% "
            "off single-process training); use 1f1b, gpipe or interleaved-1f1b"
        )
    if inputs is not None and not isinstance(model, nn.Sequential):
        _check_layers_compose(cfg, model, layers, inputs)


def check_stage_plan(cfg: TrainingConfig, shape: MeshShape, model: nn.Module, plan: dict[str, str]) -> None:
    """pp x tp: a tensor-parallel pair (a colwise run and the rowwise layer that closes it,
    in the model's order of modules) must lie within one stage, else a stage would hand on
    split activations."""
    layers = model_layers(cfg, model)
    bounds = stage_bounds(cfg.pipeline, layers, shape.pp * stages_per_rank(cfg.pipeline))
    stage_of = {name: next(s for s in range(len(bounds) - 1) if bounds[s] <= i < bounds[s + 1])
                for i, (name, _) in enumerate(layers)}
    opened = None
    for path, _ in model.named_modules():
        style = plan.get(path)
        if style is None:
            continue
        stage = stage_of.get(path.split(".")[0])
        if style == "colwise":
            opened = opened or (path, stage)
        elif opened is not None:
            if stage != opened[1]:
                raise ConfigError(
                    f"training.mesh.pp {shape.pp}: colwise '{opened[0]}' (stage {opened[1]}) and the rowwise "
                    f"'{path}' that closes it (stage {stage}) are cut apart: move the stage boundary "
                    "(training.pipeline.boundaries)"
                )
            opened = None


def describe_pipeline(cfg: TrainingConfig, shape: MeshShape, model: nn.Module) -> str:
    """Stages, the schedule's grid and its bubble: printed on the driver at start."""
    settings = cfg.pipeline
    lay, schedule = pipeline_layout(settings, shape.pp), settings.schedule
    p, m = shape.pp, settings.micro_batches
    all_layers = model_layers(cfg, model)
    bounds = stage_bounds(settings, all_layers, lay.stages)
    inner = shape.world // p  # ranks per stage position: data x tp
    lines = [
        f"pipeline: {p} stages x {inner} rank(s) each ({shape.named()}), {schedule} "
        f"({SCHEDULES[schedule].summary}), {lay.stages} stages, {m} micro-batches "
        f"of {cfg.batch_size // shape.data_world // m} rows"
    ]
    # pp is the mesh's outermost dimension: the ranks at pipeline position r are r*inner ...
    at = [_span(r * inner, inner) for r in range(p)]
    for s in range(lay.stages):
        lo, hi = bounds[s], bounds[s + 1] - 1
        layers = [all_layers[i][1] for i in range(lo, hi + 1)]
        names_ = ", ".join(type(layer).__name__ for layer in layers)
        lines.append(
            f"  stage {s} (rank{'s' if inner > 1 else ''} {at[lay.stage_rank[s]]}): "
            f"{f'layers {lo}-{hi}' if hi > lo else f'layer {lo}'} ({names_}), "
            f"{_parameters(layers):,} parameters"
        )
    lines.append(
        "  schedule (torch's action order; one column per time unit with equal stages: "
        "F 1, B 2, I 1, W 1; '.' idle):"
    )
    rows = [f"rank{'s' if inner > 1 else ''} {ranks}" for ranks in at]
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


def _span(first: int, n: int) -> str:
    return str(first) if n == 1 else f"{first}-{first + n - 1}"


def stage_layers_of(cfg: TrainingConfig, shape: MeshShape, model: nn.Module, pp_index: int) -> list[tuple[int, int, int]]:
    """(stage, first layer, last layer + 1) of each stage the rank at `pp_index` holds."""
    lay = pipeline_layout(cfg.pipeline, shape.pp)
    bounds = stage_bounds(cfg.pipeline, model_layers(cfg, model), lay.stages)
    return [(s, bounds[s], bounds[s + 1]) for s in lay.rank_stages(pp_index)]


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
