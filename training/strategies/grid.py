"""The job's ranks as a grid, before anything starts: each rank's coordinates on the mesh, its
host, its pipeline stage and layers, its tensor shard and the Parquet files it reads.
`shardline plan` prints it; a training run logs it to MLflow (mesh.txt), its hosts as the
ranks reported them. The strategy says where each rank sits (`Strategy.place`); this module
only lays the table out and names the files."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from shardline.pipelines.manifest import ShardManifest

from ..config import TrainingConfig
from ..loader.shards import rank_shards

# Files named per rank before the rest are counted: a rank of a big dataset reads hundreds.
_FILES_SHOWN = 3


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits: its coordinates (dimension -> index, those above size 1), what it
    holds of the model, and which part of each batch it reads (None: no data, a ps server)."""

    coordinates: dict[str, int] = field(default_factory=dict)
    stage: str = "all layers"
    tensor: str = "-"
    data_rank: int | None = 0


def mesh_grid(cfg: TrainingConfig, places: list[RankPlace], data_world: int, manifest: ShardManifest,
              hosts: list[str] | None, title: str) -> str:
    """The grid as text, one row per rank. hosts: each rank's, or None where the launcher
    places ranks only at launch (a Spark barrier stage, Dask workers)."""
    shards = manifest.split("train").shards
    dims = list(places[0].coordinates) if places else []
    header = ["rank", *dims, "host", "stage: layers", "tensor shard", "reads (train)"]
    rows = []
    for rank, place in enumerate(places):
        host = hosts[rank] if hosts else f"(at launch, {cfg.launcher})"
        rows.append([str(rank), *(str(place.coordinates[d]) for d in dims), host, place.stage, place.tensor,
                     _reads(shards, place.data_rank, data_world)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([title, line(header), *(line(r) for r in rows)])


def _reads(shards, data_rank: int | None, data_world: int) -> str:
    """The data part and its files (rank r of w reads shards r, r+w, ...: loader.shards)."""
    if data_rank is None:
        return "nothing (holds parameters)"
    mine = rank_shards(shards, data_rank, data_world)
    names = [os.path.basename(s.path) for s in mine]
    shown = ", ".join(names[:_FILES_SHOWN]) + (f" +{len(names) - _FILES_SHOWN} more" if len(names) > _FILES_SHOWN else "")
    return f"part {data_rank + 1}/{data_world}: {shown} ({sum(s.rows for s in mine):,} rows)"
