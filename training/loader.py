"""Rank-local batches from a prepared dataset.

Rank r of w reads shards r, r+w, r+2w, ... of a split: a disjoint, complete
cover. Every rank runs the same number of steps (DDP would hang otherwise), so
each epoch takes the same number of rows on every rank: `drop` leaves out the
rows past the smallest rank's count, freshly chosen by each epoch's shuffle.

This first loader reads the rank's shards into memory once; the streaming,
prefetching loader with exact mid-epoch resume replaces it (issue 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipelines.errors import DataError
from pipelines.manifest import ShardInfo, ShardManifest


def rank_shards(shards: list[ShardInfo], rank: int, world_size: int) -> list[ShardInfo]:
    return shards[rank::world_size]


def check_world_size(manifest: ShardManifest, split: str, world_size: int) -> None:
    n = len(manifest.split(split).shards)
    if world_size > n:
        raise DataError(
            f"world size {world_size} is greater than the {n} shard(s) of split '{split}': "
            f"re-prepare with pipelines.layout.world_size = {world_size}"
        )


def read_shards(dataset_dir: str | Path, shards: list[ShardInfo], label: str) -> tuple[
    torch.Tensor, torch.Tensor
]:
    """Features (float32 [n, d]) and labels (int64 [n]) of `shards`, in order."""
    if not shards:
        return torch.empty(0, 0), torch.empty(0, dtype=torch.int64)
    tables = []
    for s in shards:
        path = Path(dataset_dir) / s.path
        if not path.is_file():
            raise DataError(f"{path}: shard named by the manifest is missing")
        t = pq.read_table(path, columns=["features", label])
        if t.num_rows != s.rows:
            raise DataError(f"{path}: {t.num_rows} rows, the manifest says {s.rows}")
        tables.append(t)
    table = pa.concat_tables(tables)
    feats = table.column("features").combine_chunks()
    width = len(feats[0]) if len(feats) else 0
    # .flatten(), not .values: on a sliced list array .values is the whole parent.
    x = np.array(feats.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
    y = table.column(label).to_numpy()
    return torch.from_numpy(x.reshape(-1, width)), torch.from_numpy(y.astype(np.int64))


@dataclass
class RankBatches:
    """Shuffled local batches of one rank for one split."""

    features: torch.Tensor
    labels: torch.Tensor
    rows_per_epoch: int  # the same on every rank
    local_batch: int
    seed: int
    rank: int

    @classmethod
    def open(
        cls,
        manifest: ShardManifest,
        dataset_dir: str | Path,
        split: str,
        rank: int,
        world_size: int,
        local_batch: int,
        seed: int,
    ) -> RankBatches:
        check_world_size(manifest, split, world_size)
        shards = manifest.split(split).shards
        mine = rank_shards(shards, rank, world_size)
        x, y = read_shards(dataset_dir, mine, manifest.feature_spec.label)
        rows = min(
            sum(s.rows for s in rank_shards(shards, r, world_size)) for r in range(world_size)
        )
        return cls(x, y, rows, local_batch, seed, rank)

    def steps_per_epoch(self) -> int:
        return self.rows_per_epoch // self.local_batch

    def epoch(self, epoch: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 1009 + self.rank)
        order = torch.randperm(len(self.labels), generator=g)[: self.rows_per_epoch]
        for step in range(self.steps_per_epoch()):
            idx = order[step * self.local_batch : (step + 1) * self.local_batch]
            yield self.features[idx], self.labels[idx]

    def all_batches(self, batch_size: int):
        """Every row once, in order (evaluation)."""
        for i in range(0, len(self.labels), batch_size):
            yield self.features[i : i + batch_size], self.labels[i : i + batch_size]
