"""How many shards each split of a prepare gets, and the row groups they are written in.

The size rule (shards of about pipelines.layout.target_shard_bytes, a multiple of the
world size), or for train the bandwidth plan in the dataset's manifest (`shardline plan`,
prepare's --plan): the plan is checked before an engine starts (pipelines.checks) and its
train shard count once pass 1 has counted the train split's rows.
"""

from __future__ import annotations

import math

from .config import FeatureSpec, LayoutConfig, PipelineConfig
from shardline.foundation.errors import DataError
from .manifest import BandwidthPlan, ShardManifest
from .sources import display
from .splits import SPLITS
from .tasks import Parts
from .tensors import row_bytes as tensor_bytes
from .transform import feature_width


def shard_parts(report: dict, spec: FeatureSpec, cfg: PipelineConfig,
                plan: BandwidthPlan | None) -> tuple[Parts, LayoutConfig]:
    """Shards per split, from pass 1's rows and their size (train's from the plan, if any), and
    the layout they are written with."""
    rows = max(1, sum(report["rows"]))
    row_bytes = 4 * feature_width(spec) + 16 + sum(tensor_bytes(t) for t in spec.tensors.values()) \
        + report["payload"] // rows
    counts = {s: _shard_count(n, row_bytes, cfg) for s, n in zip(SPLITS, report["rows"])}
    layout = cfg.layout
    if plan is not None:
        # Only train is laid out for loading bandwidth: val and test are read once per
        # epoch for evaluation, so they keep the size rule (and get the row groups).
        counts["train"] = _planned_train_shards(report["rows"][0], plan, cfg)
        layout = layout.model_copy(update={"rows_per_row_group": plan.rows_per_row_group})
    return Parts(tuple(counts[s] for s in SPLITS)), layout


def _shard_count(rows: int, row_bytes: int, cfg: PipelineConfig) -> int:
    if rows == 0:
        return 0
    w = cfg.layout.world_size
    wanted = max(1, math.ceil(rows * row_bytes / cfg.layout.target_shard_bytes))
    return w * math.ceil(wanted / w)


def usable_plan(previous: ShardManifest | None, cfg: PipelineConfig, root: str) -> BandwidthPlan:
    if previous is None or previous.plan is None:
        raise DataError(f"{root}: no bandwidth plan to lay shards out by; run `shardline plan` first")
    plan = previous.plan
    if not (plan.shards_per_rank and plan.rows_per_row_group and plan.world_size):
        raise DataError(f"{root}: the manifest's plan is incomplete; run `shardline plan` again")
    if plan.world_size != cfg.layout.world_size:
        raise DataError(
            f"{root}: the plan is for {plan.world_size} ranks but pipelines.layout.world_size "
            f"is {cfg.layout.world_size}; set training.world_size to match and run `shardline plan` again"
        )
    return plan


def _planned_train_shards(rows: int, plan: BandwidthPlan, cfg: PipelineConfig) -> int:
    wanted = plan.shards_per_rank * cfg.layout.world_size
    if rows < wanted:
        # Hash assignment would leave shards empty and the count off a multiple of world size.
        raise DataError(
            f"{display(cfg.source.path)}: the plan wants {wanted} train shards but the train "
            f"split has {rows} rows; run `shardline plan` on this data again"
        )
    return wanted
