"""Spark and Dask prepare one raw input into the same dataset; append keeps splits and shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipelines.errors import DataError
from pipelines.hashing import hash64
from pipelines.manifest import load_manifest
from pipelines.prepare import prepare

from .test_prepare_inputs import config, raw_frame, rows_by_split, write_raw


def test_spark_and_dask_prepare_the_same_dataset(engines, tmp_path):
    df = raw_frame(3000)
    df.loc[df["id"] % 97 == 0, "city"] = None  # nulls go to the unknown index on both
    write_raw(df, tmp_path / "raw", "csv", files=3)
    out = {}
    for name in ("spark", "dask"):
        cfg = config(tmp_path, "csv")
        cfg.dataset_dir = str(tmp_path / f"ds-{name}")
        m = prepare(engines[name], cfg)
        out[name] = (m, rows_by_split(cfg))
    (ms, rs), (md, rd) = out["spark"], out["dask"]
    assert ms.engine["name"] == "spark" and md.engine["name"] == "dask"
    assert ms.statistics.categorical == md.statistics.categorical
    assert ms.statistics.num_classes == md.statistics.num_classes
    for c in ms.statistics.numeric:
        assert ms.statistics.numeric[c].mean == pytest.approx(md.statistics.numeric[c].mean, rel=1e-12)
        assert ms.statistics.numeric[c].std == pytest.approx(md.statistics.numeric[c].std, rel=1e-12)
    assert rs.keys() == rd.keys() == {"train", "val", "test"}
    for s in rs:
        assert rs[s]["id"].tolist() == rd[s]["id"].tolist()
        np.testing.assert_allclose(np.stack(rs[s]["features"]), np.stack(rd[s]["features"]), atol=1e-6)
        assert rs[s]["y"].tolist() == rd[s]["y"].tolist()
        assert [x.rows for x in ms.splits[s].shards] == [x.rows for x in md.splits[s].shards]


def test_hash_is_pinned():
    # Changing the split hash would move rows between splits of existing datasets.
    assert hash64(np.array([0, 1, -1, 2**40]), 42).tolist() == [
        int(x) for x in hash64(np.array([0, 1, -1, 2**40]), 42)
    ]
    assert int(hash64(np.array([0]), 0)[0]) == 0xE220A8397B1DCDAF  # splitmix64(0)


@pytest.mark.parametrize("engine", ["spark", "dask"])
def test_append_adds_shards_and_keeps_splits_and_statistics(engines, engine, tmp_path):
    write_raw(raw_frame(600), tmp_path / "raw", "parquet")
    cfg = config(tmp_path, "parquet")
    first = prepare(engines[engine], cfg)
    before = {s: rows_by_split(cfg)[s]["id"].tolist() for s in ("train", "val", "test")}

    new = raw_frame(300, start=600)
    new["a"] += 100  # would move the mean a lot if statistics were refitted
    cfg.source.path = str(write_raw(new, tmp_path / "raw2", "parquet"))
    second = prepare(engines[engine], cfg, append=True)

    assert second.statistics == first.statistics
    assert [Path(str(x["path"])).parent.name for x in second.sources] == ["raw", "raw", "raw2", "raw2"]
    for s in ("train", "val", "test"):
        old = first.splits[s].shards
        assert second.splits[s].shards[: len(old)] == old  # untouched: same path, sha256
        for shard in old:
            assert (Path(cfg.dataset_dir) / shard.path).is_file()
        assert len(second.splits[s].shards) % 2 == 0
    after = rows_by_split(cfg)
    for s, keys in before.items():
        got = after[s]["id"].tolist()
        assert set(keys) <= set(got)  # a row keeps its split
    assert sum(len(v) for v in after.values()) == 900

    # Same keys again: refused, naming the key; the dataset stays as it was.
    with pytest.raises(DataError, match=r"duplicate key [6-8]\d\d in column 'id'"):
        prepare(engines[engine], cfg, append=True)
    assert load_manifest(cfg.dataset_dir) == second

    # --refit: statistics over every source, all shards rewritten.
    cfg.source.path = str(write_raw(raw_frame(100, start=900), tmp_path / "raw3", "parquet"))
    third = prepare(engines[engine], cfg, append=True, refit=True)
    assert third.statistics.numeric["a"].mean > first.statistics.numeric["a"].mean + 10
    assert sum(s.rows for s in third.splits.values()) == 1000
    assert not set(x.path for x in third.splits["train"].shards) & set(
        x.path for x in first.splits["train"].shards
    )
    ids = pd.concat(rows_by_split(cfg).values())["id"]
    assert ids.is_unique and len(ids) == 1000
