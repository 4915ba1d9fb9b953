"""ShardLoader: disjoint complete cover, equal samples per rank, seeded order that threads
and engines do not change, exact resume (mid-row-group too), one-line errors for bad shards."""

from __future__ import annotations

import io
import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from shardline.foundation.errors import ConfigError, DataError
from shardline.pipelines.manifest import ShardInfo, load_manifest
from shardline.pipelines.prepare import prepare
from shardline.training.loader.reader import ShardLoader
from shardline.training.loader.shards import check_world_size, rank_shards

from .conftest import small_pipeline

# Small row groups (37 rows) in 8 train shards: batch and row-group edges rarely meet.
LAYOUT = dict(rows_per_row_group=37, target_shard_bytes=16_384, world_size=2)


@pytest.fixture(scope="module")
def datasets(engines, tmp_path_factory) -> dict[str, str]:
    """The same raw rows prepared by Spark and by Dask."""
    out = {}
    for name in ("spark", "dask"):
        cfg = small_pipeline(tmp_path_factory.mktemp(f"loader-{name}"), rows=3000, **LAYOUT)
        prepare(engines[name], cfg)
        out[name] = cfg.dataset_dir
    return out


@pytest.fixture(scope="module")
def ds(datasets) -> tuple:
    d = datasets["spark"]
    m = load_manifest(d)
    assert len(m.splits["train"].shards) >= 8 and all(s.row_groups > 1 for s in m.splits["train"].shards)
    return m, d


def _rows(dataset_dir: str, shards: list[ShardInfo]) -> list[tuple]:
    """Feature rows of `shards`, read directly with pyarrow (not through the loader)."""
    out = []
    for s in shards:
        out += [tuple(r) for r in pq.read_table(Path(dataset_dir) / s.path).column("features").to_pylist()]
    return out


def _epoch(loader: ShardLoader, epoch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(loader.epoch(epoch))


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


def _keys(batches) -> list[tuple]:
    return [tuple(r) for x, _ in batches for r in x.tolist()]


@pytest.mark.parametrize("world_size, n_shards", [(1, 1), (2, 2), (2, 3), (3, 8), (4, 7), (8, 8)])
def test_ranks_cover_their_split_disjointly_with_equal_samples(ds, world_size, n_shards):
    m, d = ds
    train = m.splits["train"].model_copy(update={"shards": m.splits["train"].shards[:n_shards]})
    m = m.model_copy(update={"splits": {**m.splits, "train": train}})
    every = _rows(d, train.shards)
    assert len(set(every)) == len(every)  # rows are identifiable by their features
    own = [set(_rows(d, rank_shards(train.shards, r, world_size))) for r in range(world_size)]
    lb = 16

    def loaders(remainder):
        return [ShardLoader(m, d, "train", r, world_size, lb, seed=3, remainder=remainder,
                            shuffle_buffer_rows=50, workers=0) for r in range(world_size)]

    # Evaluation: every row exactly once over all ranks, each rank only its own shards.
    seen = [_keys(rank.all_batches(100)) for rank in loaders("drop")]
    assert sorted(k for s in seen for k in s) == sorted(every)
    assert all(set(s) == o for s, o in zip(seen, own))

    sizes = [len(o) for o in own]
    # drop: the smallest rank's whole batches on every rank, no row twice, only own rows.
    drop = [_keys(_epoch(rank)) for rank in loaders("drop")]
    assert {len(k) for k in drop} == {min(sizes) // lb * lb}
    assert all(len(set(k)) == len(k) and set(k) <= o for k, o in zip(drop, own))
    # pad: the largest rank's rows rounded up to a batch on every rank; every own row seen.
    pad = [_keys(_epoch(rank)) for rank in loaders("pad")]
    assert {len(k) for k in pad} == {-(-max(sizes) // lb) * lb}
    assert all(set(k) == o for k, o in zip(pad, own))
    assert loaders("pad")[0].steps_per_epoch() == -(-max(sizes) // lb)


def test_order_is_seeded_per_epoch_and_reshuffles_across_row_groups(ds):
    m, d = ds

    def make(seed=1, **kw):
        return ShardLoader(m, d, "train", 0, 2, 32, seed=seed, workers=0, **kw)

    first = _epoch(make())
    assert _same(first, _epoch(make()))
    assert not _same(first, _epoch(make(), 1))
    assert not _same(first, _epoch(make(seed=2)))
    # The first batch mixes rows from several row groups (the buffer spans them).
    groups = {}
    for s in rank_shards(m.splits["train"].shards, 0, 2):
        pf = pq.ParquetFile(Path(d) / s.path)
        for g in range(pf.num_row_groups):
            for r in pf.read_row_group(g).column("features").to_pylist():
                groups[tuple(r)] = (s.path, g)
    assert len({groups[k] for k in _keys(first[:1])}) > 3


@pytest.mark.parametrize("workers, prefetch", [(1, 1), (3, 4)])
def test_loader_threads_do_not_change_the_order(ds, workers, prefetch):
    m, d = ds
    inline = _epoch(ShardLoader(m, d, "train", 1, 2, 24, seed=7, workers=0, shuffle_buffer_rows=100))
    threaded = ShardLoader(m, d, "train", 1, 2, 24, seed=7, workers=workers, prefetch=prefetch,
                           shuffle_buffer_rows=100)
    assert _same(inline, _epoch(threaded))
    stats = threaded.epoch_stats()
    assert stats["samples"] == len(inline) * 24 and stats["samples_per_s"] > 0


def test_spark_and_dask_data_give_the_same_order(datasets):
    got = {}
    for name, d in datasets.items():
        got[name] = _epoch(ShardLoader(load_manifest(d), d, "train", 1, 2, 32, seed=4, workers=0,
                                       shuffle_buffer_rows=80))
    assert len(got["spark"]) == len(got["dask"]) > 10
    for (xs, ys), (xd, yd) in zip(got["spark"], got["dask"]):
        assert torch.equal(ys, yd)
        torch.testing.assert_close(xs, xd, atol=1e-6, rtol=0)


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_resume_yields_exactly_the_remaining_batches(ds, remainder):
    m, d = ds

    def make(workers=0):
        return ShardLoader(m, d, "train", 0, 2, 16, seed=9, remainder=remainder,
                           shuffle_buffer_rows=100, workers=workers)

    loader = make()
    full = _epoch(loader, 2)
    steps = loader.steps_per_epoch()
    assert len(full) == steps and loader.state_dict()["epoch"] == 3
    # The stream (buffer 100, row groups of 37) emits 11 rows, then 37 at a time: 2 batches
    # (32 rows) end mid-row-group, 3 (48 rows) on a row group's edge; pad's last batches
    # come from the second pass over the rank's rows.
    points = [1, 2, 3, 7, steps // 2, steps - 1, steps]
    for k, workers in zip(points, [0, 2, 0, 1, 0, 2, 0]):
        partial = make()
        it = partial.epoch(2)
        head = [next(it) for _ in range(k)]
        state = partial.state_dict()
        it.close()
        assert state["epoch"] == 2 and state["batches"] == k
        buf = io.BytesIO()
        torch.save(state, buf)  # a checkpoint loads it without unpickling objects
        buf.seek(0)
        resumed = make(workers)
        resumed.load_state_dict(torch.load(buf, weights_only=True))
        rest = _epoch(resumed, 2)
        assert _same(head + rest, full), k
        assert resumed.state_dict()["epoch"] == 3 and resumed.state_dict()["batches"] == 0


def test_state_from_another_order_is_refused(ds):
    m, d = ds
    state = ShardLoader(m, d, "train", 0, 2, 16, seed=1, shuffle_buffer_rows=100).state_dict()
    other = ShardLoader(m, d, "train", 0, 2, 16, seed=1, shuffle_buffer_rows=50)
    with pytest.raises(DataError, match=r"shuffle_buffer_rows=100 \(this loader has 50\)"):
        other.load_state_dict(state)


def test_stopping_early_ends_the_loader_threads(ds):
    m, d = ds
    it = ShardLoader(m, d, "train", 0, 2, 16, seed=1, workers=3, prefetch=1).epoch(0)
    next(it)
    it.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("shardline-decode")]


def test_world_size_above_shard_count_says_how_to_fix(ds):
    m, d = ds
    n = len(m.splits["train"].shards)
    with pytest.raises(DataError, match=rf"world size {n + 1} is greater than the {n} shard\(s\) of split 'train': "
                       rf"re-prepare with pipelines.layout.world_size = {n + 1}"):
        check_world_size(m, "train", n + 1)
    with pytest.raises(DataError, match=rf"re-prepare with pipelines.layout.world_size = {n + 1}"):
        ShardLoader(m, d, "train", 0, n + 1, 16, seed=0)


def test_unknown_split_and_bad_settings(ds):
    m, d = ds
    with pytest.raises(DataError, match=r"dataset has no 'holdout' split \(splits with data: train, val, test\)"):
        ShardLoader(m, d, "holdout", 0, 2, 16, seed=0)
    with pytest.raises(ConfigError, match=r"training.remainder 'wrap' is not one of: drop, pad"):
        ShardLoader(m, d, "train", 0, 2, 16, seed=0, remainder="wrap")
    with pytest.raises(ConfigError, match=r"training.prefetch_depth is 0; it must be at least 1"):
        ShardLoader(m, d, "train", 0, 2, 16, seed=0, prefetch=0)


@pytest.fixture
def copy(ds, tmp_path):
    m, d = ds
    shutil.copytree(d, tmp_path / "ds")
    return load_manifest(tmp_path / "ds"), str(tmp_path / "ds")


def test_changed_shard_bytes_fail_verification_naming_the_shard(copy):
    m, d = copy
    shard = m.splits["train"].shards[2]
    path = Path(d) / shard.path
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # inside the data pages; the footer still parses
    path.write_bytes(bytes(data))
    ShardLoader(m, d, "train", 0, 2, 16, seed=0)  # unverified, the footer alone looks fine
    with pytest.raises(DataError, match=rf"{shard.path}: sha256 \w+\.\.\. differs from the manifest's"):
        ShardLoader(m, d, "train", 0, 2, 16, seed=0, verify=True)


def test_row_count_mismatch_names_the_shard(copy):
    m, d = copy
    shard = m.splits["train"].shards[1]
    # A shard rewritten with fewer rows behind the manifest's back.
    path = Path(d) / shard.path
    table = pq.read_table(path)
    pq.write_table(table.slice(0, 5), path)
    with pytest.raises(DataError, match=rf"{shard.path}: 5 rows, the manifest says {shard.rows}"):
        ShardLoader(m, d, "train", 1, 2, 16, seed=0)
    ShardLoader(m, d, "train", 0, 2, 16, seed=0)  # rank 0 never opens it


def test_manifest_that_disagrees_with_a_shard_footer_names_the_shard(ds):
    m, d = ds

    def with_shard(i, **update):
        shards = list(m.splits["train"].shards)
        shards[i] = shards[i].model_copy(update=update)
        train = m.splits["train"].model_copy(update={"shards": shards})
        return m.model_copy(update={"splits": {**m.splits, "train": train}})

    shard = m.splits["train"].shards[3]
    with pytest.raises(DataError, match=rf"{shard.path}: {shard.rows} rows, the manifest says {shard.rows + 1}$"):
        ShardLoader(with_shard(3, rows=shard.rows + 1), d, "train", 1, 2, 16, seed=0)
    with pytest.raises(DataError, match=rf"{shard.path}: {shard.row_groups} row groups, the manifest says 1$"):
        ShardLoader(with_shard(3, row_groups=1), d, "train", 1, 2, 16, seed=0)


def test_shard_gone_mid_epoch_is_one_error_in_the_training_thread(copy):
    m, d = copy
    loader = ShardLoader(m, d, "train", 0, 2, 16, seed=0, workers=2)
    for s in rank_shards(m.splits["train"].shards, 0, 2):
        (Path(d) / s.path).unlink()
    with pytest.raises(DataError, match=r"shard-\d+\.parquet: row group \d+ cannot be read"):
        _epoch(loader)
