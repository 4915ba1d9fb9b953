"""The Spark prepare stage and the manifest contract, on real Spark."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from shardline.foundation.errors import DataError
from shardline.pipelines.manifest import load_manifest
from shardline.pipelines.prepare import prepare

from .conftest import small_pipeline


def _split_table(cfg, split):
    m = load_manifest(cfg.dataset_dir)
    return pq.read_table(
        [str(Path(cfg.dataset_dir) / s.path) for s in m.splits[split].shards]
    ) if m.splits[split].shards else None


def test_manifest_describes_the_shards(prepared):
    m = load_manifest(prepared.dataset_dir)
    assert m.engine["name"] == "spark" and m.engine["version"].startswith("4.")
    assert sum(s.rows for s in m.splits.values()) == 6000
    for split, info in m.splits.items():
        assert len(info.shards) % m.layout.world_size == 0, split
        for shard in info.shards:
            path = Path(prepared.dataset_dir) / shard.path
            data = path.read_bytes()
            assert hashlib.sha256(data).hexdigest() == shard.sha256
            assert len(data) == shard.bytes
            pf = pq.ParquetFile(path)
            assert pf.metadata.num_rows == shard.rows
            assert pf.metadata.num_row_groups == shard.row_groups
    assert [f["name"] for f in m.arrow_schema] == ["key", "features", "label"]
    assert m.tensors["features"].shape == [9]


def test_splits_are_disjoint_complete_and_follow_the_fractions(prepared):
    keys = {s: set(_split_table(prepared, s).column("key").to_pylist()) for s in ("train", "val", "test")}
    assert not (keys["train"] & keys["val"] or keys["train"] & keys["test"] or keys["val"] & keys["test"])
    assert set().union(*keys.values()) == set(range(6000))
    assert 0.75 < len(keys["train"]) / 6000 < 0.85


def test_numeric_statistics_are_fitted_on_train_only(prepared):
    m = load_manifest(prepared.dataset_dir)
    x = np.array(_split_table(prepared, "train").column("features").to_pylist())
    n = len(m.feature_spec.numeric)
    np.testing.assert_allclose(x[:, :n].mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(x[:, :n].std(0), 1, atol=1e-3)
    raw = pq.read_table(prepared.source.path)
    assert m.statistics.numeric["x0"].mean != pytest.approx(
        float(np.mean(raw.column("x0").to_numpy())), abs=1e-9
    )  # all rows differ from train rows: the fit really excluded val/test
    vocab = m.statistics.categorical["color"]
    cats = x[:, n]
    assert set(np.unique(cats)) <= set(range(1, len(vocab) + 1))


def test_shards_are_sorted_by_key_and_rank_balanced(prepared):
    m = load_manifest(prepared.dataset_dir)
    for shard in m.splits["train"].shards:
        keys = pq.read_table(Path(prepared.dataset_dir) / shard.path).column("key").to_numpy()
        assert (np.diff(keys) > 0).all()
    rows = [s.rows for s in m.splits["train"].shards]
    assert max(rows) / min(rows) < 1.15  # hash-balanced; tighter bound needs more rows


@pytest.mark.parametrize("engine", ["spark", "dask"])
def test_prepare_is_deterministic_and_replaces_the_previous_version(engines, engine, tmp_path):
    cfg = small_pipeline(tmp_path, rows=1500)
    first = prepare(engines[engine], cfg)
    second = prepare(engines[engine], cfg)
    assert first.version_id != second.version_id
    assert [s.sha256 for s in first.splits["train"].shards] == [
        s.sha256 for s in second.splits["train"].shards
    ]
    # The newest committed version is the dataset; the one before it stays for the
    # default retention (2 versions), for jobs that started on it.
    assert load_manifest(cfg.dataset_dir) == second
    assert sorted(p.name for p in Path(cfg.dataset_dir).iterdir()) == sorted(
        ["_manifests", f"v-{first.version_id}", f"v-{second.version_id}"]
    )


@pytest.mark.parametrize("engine", ["spark", "dask"])
def test_refuses_to_write_into_a_foreign_directory(engines, engine, tmp_path):
    cfg = small_pipeline(tmp_path, rows=500)
    Path(cfg.dataset_dir).mkdir()
    (Path(cfg.dataset_dir) / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not a shardline dataset"):
        prepare(engines[engine], cfg)
    assert [p.name for p in Path(cfg.dataset_dir).iterdir()] == ["notes.txt"]


def test_unknown_manifest_version_is_refused(tmp_path):  # a dataset of the single-manifest layout
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(DataError, match="format version 99 is not supported"):
        load_manifest(tmp_path)


def test_shard_assignment_is_balanced_where_a_split_has_enough_rows():
    import numpy as np

    from shardline.pipelines.config import SplitConfig
    from shardline.pipelines.rows import shard_hash, split_of

    def shard_of(hashes, splits, shards):  # a row's shard within its split: its shard hash mod the count
        out = np.zeros(len(hashes), np.int32)
        for s, n in shards.items():
            out[splits == s] = hashes[splits == s] % n
        return out

    keys = np.arange(1_000_000, 1_200_000)
    splits = split_of(keys, SplitConfig())
    for n in (2, 4, 6):
        shard = shard_of(shard_hash(keys), splits, {"train": n, "val": 2, "test": 2})
        counts = np.bincount(shard[splits == "train"], minlength=n)
        assert counts.max() / counts.min() <= 1.05, (n, counts)
