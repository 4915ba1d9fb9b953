"""Spark and Dask prepare one raw input into byte-identical datasets; the hashes are pinned.

"Byte-identical" here means: every shard file has the same sha256, and the
manifests are equal once their provenance is set aside (`fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from shardline.pipelines.config import SplitConfig
from shardline.foundation.errors import DataError
from shardline.pipelines.hashing import hash64
from shardline.pipelines.manifest import load_manifest, manifest_url, sequences
from shardline.pipelines.prepare import prepare
from shardline.pipelines.rows import shard_hash, split_of
from shardline.pipelines.splits import SHARD_SALT, SPLIT_SALT

from .conftest import small_pipeline
from .test_prepare_inputs import config, raw_frame, rows_by_split, write_raw

# What legitimately differs between two prepares of one input: which engine (and
# version) wrote it, when, and the version id (which also names the shard folder).
PROVENANCE = ("engine", "created_at", "version_id")


def fingerprint(dataset_dir: str) -> dict:
    """sha256 of every shard file (read from disk) and of the manifest without provenance."""
    newest = manifest_url(dataset_dir, sequences(dataset_dir)[-1])  # _manifests/manifest-<n>.json
    manifest = json.loads(Path(newest).read_text())
    version = f"v-{manifest['version_id']}/"
    shards = {}
    for split, info in manifest["splits"].items():
        for s in info["shards"]:
            digest = hashlib.sha256((Path(dataset_dir) / s["path"]).read_bytes()).hexdigest()
            assert digest == s["sha256"]
            shards[s["path"].replace(version, "")] = digest
    if manifest.get("rejects"):  # the dropped rows' keys and reasons: the same bytes too
        path = manifest["rejects"]["path"]
        shards[path.replace(version, "")] = hashlib.sha256((Path(dataset_dir) / path).read_bytes()).hexdigest()
    for field in PROVENANCE:
        manifest.pop(field)
    canonical = json.dumps(manifest, sort_keys=True).replace(version, "v-*/")
    return {"manifest": hashlib.sha256(canonical.encode()).hexdigest(), "shards": shards}


def engine_dirs(cfg) -> dict[str, str]:
    """Where prepare_both writes each engine's dataset: `cfg.dataset_dir` suffixed by the engine."""
    return {name: f"{cfg.dataset_dir}-{name}" for name in ("spark", "dask")}


def prepare_both(engines, cfg) -> dict[str, dict]:
    out = {}
    for name, folder in engine_dirs(cfg).items():
        c = cfg.model_copy(update={"dataset_dir": folder})
        prepare(engines[name], c)
        out[name] = fingerprint(c.dataset_dir)
    return out


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_spark_and_dask_write_byte_identical_datasets(engines, fmt, tmp_path):
    df = raw_frame(3000)
    df.loc[df["id"] % 97 == 0, "city"] = None  # nulls go to the unknown index on both
    write_raw(df, tmp_path / "raw", fmt, files=3)
    got = prepare_both(engines, config(tmp_path, fmt))
    assert len(got["spark"]["shards"]) >= 6
    assert got["spark"] == got["dask"]


def test_vectors_hash_encoding_and_regression_are_byte_identical(engines, tmp_path):
    df = raw_frame(1200)
    df["emb"] = [[float(k), 0.5, -float(k)] for k in df["id"]]
    df["y"] = df["a"] * 2.0
    write_raw(df, tmp_path / "raw", "parquet", files=3)
    cfg = config(tmp_path, "parquet", vectors={"emb": 3}, categorical_encoding="hash", hash_buckets=16,
                 task="regression")
    got = prepare_both(engines, cfg)
    assert got["spark"] == got["dask"]


MESSY = """id,a,b,city,y
1, 1.5 ,2,paris,0
2,seven,3,lima,1
3,n/a,4,oslo,2
4,NULL,5,NULL,0
5,,6,,1
6,NaN,7,paris,2
7,inf,8,lima,0
8,2.5,9,oslo,1
9,1e3,-1,None,0
10,4,5,paris,x
11,5,6,lima,
+12,6,7,oslo,1
"""


def _messy(tmp_path: Path) -> Path:
    """Two CSV files: the messy rows above, then clean rows, with key 8 again in the second."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "part-0.csv").write_text(MESSY)
    clean = raw_frame(400, start=100)
    clean.loc[clean.index[5], "id"] = 8  # a repeated key, in a later file
    clean.to_csv(raw / "part-1.csv", index=False)
    return raw


def test_a_messy_file_gives_the_same_first_error_and_dataset_on_both_engines(engines, tmp_path):
    _messy(tmp_path)
    cfg = config(tmp_path, "csv")

    def first_error(c) -> set[str]:
        errors = set()
        for name in ("spark", "dask"):
            with pytest.raises(DataError) as e:
                prepare(engines[name], c.model_copy(update={"dataset_dir": f"{c.dataset_dir}-{name}"}))
            errors.add(str(e.value))
        assert len(errors) == 1, errors  # the same message from both engines
        return errors

    # Defaults fail at the first unusable row in file and row order: 'seven' in row 2.
    (msg,) = first_error(cfg)
    assert re.search(r"part-0\.csv: column 'a', key 2: value 'seven': value does not parse", msg)
    # Counted once each: 'seven', labels 'x' and '' (10, 11), invalid 'a' in rows 3 to 7.
    assert msg.endswith("(8 bad row(s) in all)"), msg
    # Dropping bad rows, invalid features still fail: 'n/a' (a null token) in row 3.
    cfg.source.on_bad_rows = "drop"
    (msg,) = first_error(cfg)
    assert re.search(r"part-0\.csv: column 'a', key 3: value 'n/a': feature is NaN, inf or null .*\(5 bad row\(s\) in all\)", msg)
    # Fail on repeats only: the second row with key 8 (part-1.csv) is named with the first.
    cfg.source.on_bad_rows = "fail"
    (tmp_path / "raw" / "part-0.csv").write_text("id,a,b,city,y\n8,2.5,9,oslo,1\n")
    (msg,) = first_error(cfg)
    assert re.search(r"part-0\.csv, .*part-1\.csv: duplicate key 8 in column 'id'", msg)

    # Drop + impute: one dataset, byte for byte.
    (tmp_path / "raw" / "part-0.csv").write_text(MESSY)
    cfg.source.on_bad_rows = "drop"
    cfg.features.on_invalid_features = "impute"
    got = prepare_both(engines, cfg)
    assert got["spark"] == got["dask"]

    ds = cfg.model_copy(update={"dataset_dir": f"{cfg.dataset_dir}-dask"})
    m = load_manifest(ds.dataset_dir)
    # Dropped: 'seven' (2), label 'x' (10), empty label (11), the later key 8.
    assert m.dropped_rows == 4
    # Each dropped row by key, reason, column, file and row (0-based, header not counted).
    assert m.rejects is not None and (m.rejects.rows, m.rejects.total, m.rejects.cap) == (4, 4, 10_000)
    assert "_rejects/rejects.parquet" in got["dask"]["shards"]  # compared above, byte for byte
    rejects = pq.read_table(Path(ds.dataset_dir) / m.rejects.path).to_pylist()
    raw = tmp_path / "raw"
    assert [(r["key"], r["reason"], r["column"], r["file"], r["row"], r["value"]) for r in rejects] == [
        ("2", "unparseable", "a", str(raw / "part-0.csv"), 1, "seven"),
        ("10", "unparseable", "y", str(raw / "part-0.csv"), 9, "x"),
        ("11", "null_label", "y", str(raw / "part-0.csv"), 10, ""),
        ("8", "duplicate_key", "id", str(raw / "part-1.csv"), 5, "8"),
    ]
    rows = pd.concat(rows_by_split(ds).values()).set_index("id")
    assert not {2, 10, 11} & set(rows.index) and rows.index.is_unique
    assert len(rows) == 12 + 400 - 4
    a_mean, a_std = m.statistics.numeric["a"].mean, m.statistics.numeric["a"].std
    assert rows.loc[8, "features"][0] == pytest.approx((2.5 - a_mean) / a_std, rel=1e-6)  # the first key 8
    for k in (3, 4, 5, 6, 7):  # n/a, NULL, empty, NaN, inf: imputed with the train mean
        assert rows.loc[k, "features"][0] == 0.0
    assert rows.loc[12, "features"][0] == pytest.approx((6 - a_mean) / a_std, rel=1e-6)  # key '+12'
    for k in (4, 5, 9):  # NULL, empty, None: the unknown category
        assert rows.loc[k, "features"][2] == 0.0
    assert rows.loc[1, "features"][2] == 1 + m.statistics.categorical["city"].index("paris")


def test_the_split_and_shard_hashes_are_pinned():
    """Changing a hash moves rows between splits and shards of existing datasets (and of
    appends to them). Pinned to an independent splitmix64 and to known outputs."""
    mask = (1 << 64) - 1

    def splitmix64(x: int, salt: int) -> int:  # Steele, Lea & Flood (2014), as published
        z = (x + salt * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    keys = [0, 1, 2, 7, 42, 1000, -1, -(2**62), 2**40, 123456789012]
    for salt in (0, SPLIT_SALT, SHARD_SALT):
        assert hash64(np.array(keys), salt).tolist() == [splitmix64(k & mask, salt) for k in keys]
    assert splitmix64(0, 0) == 0xE220A8397B1DCDAF  # the reference generator's first output
    assert [hex(int(h)) for h in hash64(np.array(keys), SPLIT_SALT)] == [
        "0x7dc930b302278a8", "0x3c821fbf59108163", "0x21aa27732571887", "0x61cc42d4094b9c40",
        "0x45e78cf4fe332d8c", "0x74a1180775fbd9e0", "0xbe2af7de053863b", "0x1ac054d8ae3636af",
        "0x833797ab7a937171", "0x359d991e80431c62",
    ]
    assert split_of(np.array(keys), SplitConfig()).tolist() == [
        "val", "test", "test", "train", "train", "train", "val", "test", "train", "train",
    ]
    assert shard_hash(np.array(keys)).tolist() == [
        8009308274881266754, 8967309288374508532, 8206052204579207569, 7861341929156172992,
        8154002619268187357, 2201560229172917234, 2132996539772193759, 5851867818274552062,
        282009851668106157, 4651625551878922356,
    ]


def content_digest(dataset_dir: str) -> str:
    """sha256 of every shard's columns in order (not the file bytes: those also carry the
    Parquet writer's version)."""
    m = load_manifest(dataset_dir)
    h = hashlib.sha256()
    for split in ("train", "val", "test"):
        for i, shard in enumerate(m.splits[split].shards):
            t = pq.read_table(Path(dataset_dir) / shard.path)
            h.update(f"{split}/{i}".encode())
            for c in t.column_names:
                a = t.column(c).combine_chunks()
                h.update((a.flatten() if c == "features" else a).to_numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("engine", ["spark", "dask"])
def test_the_dataset_is_what_the_previous_release_wrote(engines, engine, tmp_path):
    # Digest of the 1,500-row synthetic dataset as shardline wrote it before the one-parse
    # rewrite (on both engines): splits, shards, row order, features and labels unchanged.
    cfg = small_pipeline(tmp_path, rows=1500)
    prepare(engines[engine], cfg)
    assert content_digest(cfg.dataset_dir) == "dab2be8e92c58793ff7748484e61453ffb45e0951c7abfc5bd933ba7f49f2997"


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
    with pytest.raises(DataError, match=r"v-\w+/\w+/shard-\d+\.parquet, .*raw2/part-0\.parquet: duplicate key 600 in column 'id'"):
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


def test_spark_routes_each_part_to_its_own_partition(spark):
    from pyspark.sql import functions as F

    from shardline.engines.spark.prepare import spark_partition, spark_routes

    for n in (1, 2, 6, 13):
        got = spark.range(0, 200).select(F.pmod(F.hash(F.col("id").cast("int")), F.lit(n)).alias("p")).collect()
        assert [r["p"] for r in got] == [spark_partition(i, n) for i in range(200)]
        routes = spark_routes(n)
        assert [spark_partition(int(r), n) for r in routes] == list(range(n))
        assert [int(r) % n for r in routes] == list(range(n))


def test_rejects_are_capped_in_file_and_row_order():
    """The rejects file keeps the first CAP dropped rows by position (unit, then row), from
    pass 1's reports and pass 2's repeated keys alike; each unit reports its share."""
    from shardline.pipelines import rejects
    from shardline.pipelines.raw import Unit

    units = [Unit(0, "file:///d/a.csv", "csv"), Unit(1, "file:///d/b.parquet", "parquet", first_row=100)]
    reported = [[1, 2 * i, str(i), "null_label", "y", units[1].url, 100 + 2 * i, None] for i in range(rejects.CAP)]
    repeats = {"rejects": json.dumps([[7, (0 << 32) | 3], [9, (1 << 32) | 5]])}  # unit 0 row 3, unit 1 row 5
    kept = rejects.collect(reported, [repeats, {"rejects": None}], units, "id")
    assert len(kept) == rejects.CAP
    assert kept[0] == [0, 3, "7", "duplicate_key", "id", units[0].url, 3, "7"]  # first by position
    assert kept[4] == [1, 5, "9", "duplicate_key", "id", units[1].url, 105, "9"]  # between rows 4 and 6
    assert kept[-1][1] == 2 * (rejects.CAP - 3)  # the last two reported fell past the cap
    assert rejects.per_unit(1) == rejects.CAP and rejects.per_unit(10**6) == rejects.MIN_PER_UNIT
