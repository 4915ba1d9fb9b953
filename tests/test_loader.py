"""Rank-local batches: disjoint, complete, equal steps per rank, deterministic."""

from __future__ import annotations

import pytest
import torch

from pipelines.errors import DataError
from pipelines.manifest import ShardInfo, load_manifest
from training.loader import RankBatches, check_world_size, rank_shards


@pytest.mark.parametrize("world_size, n_shards", [(1, 1), (2, 2), (2, 6), (3, 6), (4, 8)])
def test_rank_shards_are_a_disjoint_complete_cover(world_size, n_shards):
    shards = [ShardInfo(path=f"s{i}", rows=10, bytes=1, row_groups=1, sha256="") for i in range(n_shards)]
    taken = [s.path for r in range(world_size) for s in rank_shards(shards, r, world_size)]
    assert sorted(taken) == sorted(s.path for s in shards)
    assert len(set(taken)) == len(taken)
    assert len({len(rank_shards(shards, r, world_size)) for r in range(world_size)}) == 1


def test_ranks_run_equal_steps_over_their_own_rows(prepared):
    m = load_manifest(prepared.dataset_dir)
    ranks = [RankBatches.open(m, prepared.dataset_dir, "train", r, 2, 64, seed=1) for r in range(2)]
    assert ranks[0].steps_per_epoch() == ranks[1].steps_per_epoch() > 0
    seen = [torch.cat([x for x, _ in rb.epoch(0)]) for rb in ranks]
    assert len(seen[0]) == len(seen[1]) == ranks[0].steps_per_epoch() * 64
    # Each rank's batches come from its own shards only.
    own = [rb.features for rb in ranks]
    assert not set(map(tuple, seen[0].tolist())) - set(map(tuple, own[0].tolist()))
    assert not set(map(tuple, seen[0].tolist())) & set(map(tuple, own[1].tolist()))


def test_shuffle_is_seeded_and_changes_per_epoch(prepared):
    m = load_manifest(prepared.dataset_dir)
    a = RankBatches.open(m, prepared.dataset_dir, "train", 0, 2, 64, seed=1)
    b = RankBatches.open(m, prepared.dataset_dir, "train", 0, 2, 64, seed=1)
    first = [y for _, y in a.epoch(0)]
    assert all(torch.equal(p, q) for p, q in zip(first, [y for _, y in b.epoch(0)]))
    assert not all(torch.equal(p, q) for p, q in zip(first, [y for _, y in a.epoch(1)]))


def test_world_size_above_shard_count_says_how_to_fix(prepared):
    m = load_manifest(prepared.dataset_dir)
    with pytest.raises(DataError, match=r"re-prepare with pipelines.layout.world_size = 8"):
        check_world_size(m, "train", 8)


def test_row_count_mismatch_names_the_shard(prepared, tmp_path):
    m = load_manifest(prepared.dataset_dir)
    shard = m.splits["train"].shards[0].model_copy(update={"rows": 1})
    from training.loader import read_shards

    with pytest.raises(DataError, match=r"shard-00000.parquet: \d+ rows, the manifest says 1"):
        read_shards(prepared.dataset_dir, [shard], "label")
