"""Sizing a job before it runs: `shardline.plan` and `shardline.forecast` (shardline.api).

`plan` measures the configured model's training rate and the loader's on the dataset in
this process and stores a loader layout in the dataset's manifest; `forecast` measures
per-core rates on a sample and forecasts prepare, an epoch and scoring on a cluster of a
given size. Neither starts an engine.
"""

# What a user's code calls: type-checked in pyright's basic mode ([tool.pyright] in pyproject.toml).
# pyright: basic
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardline.config import DATASET, SOURCE, check_storage, load_config, resolve_paths
from shardline.engines import engine_class
from shardline.foundation.errors import ConfigError
from shardline.foundation.report import stage
from shardline.pipelines.manifest import ShardManifest, store_plan

# Imported inside the functions that use them: training.job, training.plan and
# training.rank_grid (import torch); shardline.forecasting (measures with torch).

if TYPE_CHECKING:
    from shardline.api import Config, Overrides


@dataclass
class PlanResult:
    dataset_dir: str
    manifest: ShardManifest  # the version the plan was stored into
    plan: Any  # pipelines.manifest.BandwidthPlan
    grid: str = ""  # the ranks on the mesh: coordinates, host, stage, tensor shard, files read

    def to_dict(self) -> dict:
        return self.plan.model_dump(mode="json")


def plan(config: Config = None, overrides: Overrides = ()) -> PlanResult:
    """Measure the configured model's training rate and the loader's rate on the dataset,
    choose loader workers, shards per rank and rows per row group so loading keeps ahead of
    training, and store that plan in the dataset's manifest (`prepare(by_plan=True)` lays
    shards out by it). Measured in this process."""
    from shardline.training.job import preflight
    from shardline.training.plan import measured_loader, plan_dataset
    from shardline.training.rank_grid import rank_grid

    cfg = resolve_paths(load_config(config, overrides), [])
    check_storage(cfg, writes=(DATASET,))
    t, where = cfg.training, cfg.pipelines.dataset_dir
    checked = preflight(t, where)  # no dataset, bad settings: one line, before measuring
    measured_loader(checked, where, t)  # an epoch too short to time the loader: the same
    grid = rank_grid(t, checked, engine_class(t.launcher, "training.launcher").hosts_before_launch(t.world_size))
    with stage(f"Measuring {t.model} {t.hidden} and the loader on {where}"):
        measured, p = plan_dataset(t, where, manifest=checked)
    return PlanResult(where, store_plan(where, measured.version_id, p), p, grid)


@dataclass
class ForecastResult:
    forecast: Any  # shardline.forecasting.Forecast
    measured: Any  # shardline.forecasting.Measured: what it was made from
    stored: str | None  # the dataset folder's forecast file, logged by the next training run

    def to_dict(self) -> dict:
        from shardline.forecasting import to_json

        return {**to_json(self.forecast, self.measured), "stored": self.stored}


def forecast(config: Config = None, overrides: Overrides = (), *, hosts: int, cores: int, gpus: int = 0,
             sample_rows: int | None = None) -> ForecastResult:
    """Forecast prepare, an epoch and scoring on `hosts` x `cores` (x `gpus`) for
    pipelines.engine: per-core rates measured in this process on the first `sample_rows`
    rows of pipelines.source (seconds), the layout chosen, wall time and memory of each
    stage. Stored beside the dataset for the next training run's MLflow run. Starts no engine."""
    from shardline import forecasting as fc

    if min(hosts, cores) < 1 or gpus < 0:
        raise ConfigError(f"--hosts and --cores are at least 1 and --gpus at least 0 (got {hosts}, {cores}, {gpus})")
    cfg = resolve_paths(load_config(config, overrides), [], (SOURCE, DATASET))
    p = cfg.pipelines
    if p.source.format != "synthetic":
        check_storage(cfg, reads=(SOURCE,))
    cluster = fc.Cluster(hosts=hosts, cores=cores, gpus=gpus)
    with stage(f"Forecast for {hosts} host(s) x {cores} core(s){f' x {gpus} GPU(s)' if gpus else ''} on {p.engine}"):
        measured = fc.measure(cfg, sample_rows or fc.SAMPLE_ROWS)
    f = fc.forecast(measured, cfg, cluster, p.engine)
    return ForecastResult(f, measured, fc.store(f, measured, p.dataset_dir))
