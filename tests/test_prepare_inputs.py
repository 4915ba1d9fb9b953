"""Sources, feature kinds and bad input, on both engines: one clear line, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.engines import LocalEngine
from shardline.pipelines.config import PipelineConfig
from shardline.foundation.errors import DataError
from shardline.pipelines.manifest import load_manifest
from shardline.pipelines.prepare import prepare

ENGINES = ["spark", "dask"]


def raw_frame(rows: int = 400, start: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(start)
    keys = np.arange(start, start + rows)
    return pd.DataFrame(
        {
            "id": keys,
            "a": rng.normal(5, 2, rows),
            "b": rng.normal(-1, 0.5, rows),
            "city": rng.choice(["paris", "lima", "oslo"], rows),
            "y": (keys % 3).astype(np.int64),
        }
    )


def write_raw(df: pd.DataFrame, path: Path, fmt: str, files: int = 2) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(np.array_split(df, files)):
        f = path / f"part-{i}.{ {'parquet': 'parquet', 'csv': 'csv', 'json': 'jsonl'}[fmt] }"
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pandas(part, preserve_index=False), f)
        elif fmt == "csv":
            part.to_csv(f, index=False)
        else:
            part.to_json(f, orient="records", lines=True)
    return path


def config(tmp: Path, fmt: str, **features) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "dataset_dir": str(tmp / "dataset"),
            "source": {"format": fmt, "path": str(tmp / "raw")},
            "features": {
                "key": "id",
                "label": "y",
                "numeric": ["a", "b"],
                "categorical": ["city"],
                **features,
            },
            "layout": {"world_size": 2},
        }
    )


def rows_by_split(cfg: PipelineConfig) -> dict[str, pd.DataFrame]:
    m = load_manifest(cfg.dataset_dir)
    return {
        s: pq.read_table([str(Path(cfg.dataset_dir) / x.path) for x in info.shards]).to_pandas()
        for s, info in m.splits.items()
        if info.shards
    }


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_csv_and_json_give_the_same_dataset_as_parquet(engines, engine, fmt, tmp_path):
    df = raw_frame()
    ref_cfg = config(tmp_path / "pq", "parquet")
    write_raw(df, tmp_path / "pq" / "raw", "parquet")
    prepare(engines[engine], ref_cfg)
    cfg = config(tmp_path / fmt, fmt)
    write_raw(df, tmp_path / fmt / "raw", fmt)
    prepare(engines[engine], cfg)
    ref, got = rows_by_split(ref_cfg), rows_by_split(cfg)
    assert ref.keys() == got.keys()
    for s in ref:
        assert ref[s]["id"].tolist() == got[s]["id"].tolist()
        np.testing.assert_allclose(np.stack(ref[s]["features"]), np.stack(got[s]["features"]), atol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_vectors_hashed_categories_and_regression(engines, engine, tmp_path):
    df = raw_frame()
    df["emb"] = [list(np.arange(3) + k) for k in df["id"]]
    df["y"] = df["a"] * 2.0
    write_raw(df, tmp_path / "raw", "parquet")
    cfg = config(
        tmp_path, "parquet", vectors={"emb": 3}, categorical_encoding="hash", hash_buckets=16,
        task="regression",
    )
    m = prepare(engines[engine], cfg)
    assert m.tensors["features"].shape == [2 + 3 + 1]
    assert m.tensors["label"].dtype == "float32"
    assert m.statistics.cardinality == {"city": 16} and m.statistics.categorical == {"city": []}
    train = rows_by_split(cfg)["train"]
    x = np.stack(train["features"])
    np.testing.assert_allclose(x[:, 2:5], np.stack([np.arange(3) + k for k in train["id"]]))
    assert set(x[:, 5]) <= set(range(1, 17))
    np.testing.assert_allclose(train["y"], df.set_index("id").loc[train["id"], "a"] * 2, rtol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_json_url_input(engines, engine, tmp_path):
    write_raw(raw_frame(), tmp_path / "raw", "json")
    cfg = config(tmp_path, "json")
    cfg.source.path = f"file://{tmp_path / 'raw'}"
    m = prepare(engines[engine], cfg)
    assert sum(s.rows for s in m.splits.values()) == 400


# -- bad input: one line naming the file/column/key; the dataset dir never appears ---------


def _fails(engines, engine, cfg, pattern):
    with pytest.raises(DataError, match=pattern) as e:
        prepare(engines[engine], cfg)
    assert "\n" not in str(e.value)
    assert not Path(cfg.dataset_dir).exists()
    return str(e.value)


@pytest.mark.parametrize("engine", ENGINES)
def test_missing_input(engines, engine, tmp_path):
    _fails(engines, engine, config(tmp_path, "parquet"), r"raw: input not found")


@pytest.mark.parametrize("engine", ENGINES)
def test_corrupt_parquet_file_is_named(engines, engine, tmp_path):
    write_raw(raw_frame(), tmp_path / "raw", "parquet")
    (tmp_path / "raw" / "part-1.parquet").write_bytes(b"PAR1 this is not parquet")
    _fails(engines, engine, config(tmp_path, "parquet"), r"part-1\.parquet: not a readable Parquet file")


@pytest.mark.parametrize("engine", ENGINES)
def test_unparseable_csv_value_fails_or_is_dropped(engines, engine, tmp_path):
    df = raw_frame().astype({"a": object})
    df.loc[df["id"] == 7, "a"] = "seven"
    write_raw(df, tmp_path / "raw", "csv")
    cfg = config(tmp_path, "csv")
    _fails(engines, engine, cfg, r"part-0\.csv: column 'a', key '?7'?: value 'seven': value does not parse")
    cfg.source.on_bad_rows = "drop"
    m = prepare(engines[engine], cfg)
    assert m.dropped_rows == 1
    assert sum(s.rows for s in m.splits.values()) == 399


def test_the_first_bad_value_counts_every_bad_row_once(engines, tmp_path):
    """Bad rows in different columns, one of them bad twice: the count is of rows, not of
    the first problem's column (which holds one)."""
    df = raw_frame().astype({"a": object, "b": object})
    df.loc[df["id"] == 7, "a"] = "seven"
    df.loc[df["id"] == 9, "b"] = "nine"
    df.loc[df["id"] == 11, ["a", "b"]] = ["x", "y"]
    write_raw(df, tmp_path / "raw", "csv", files=1)
    _fails(engines, "dask", config(tmp_path, "csv"),
           r"part-0\.csv: column 'a', key '?7'?: value 'seven': value does not parse.* \(3 bad row\(s\) in all\)$")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("column", ["id", "y"])
def test_missing_key_or_label_column(engines, engine, column, tmp_path):
    write_raw(raw_frame().drop(columns=[column]), tmp_path / "raw", "parquet")
    _fails(engines, engine, config(tmp_path, "parquet"), rf"column '{column}' not found")


@pytest.mark.parametrize("engine", ENGINES)
def test_duplicate_keys_are_named(engines, engine, tmp_path):
    df = raw_frame()
    df.loc[df["id"] == 350, "id"] = 3
    write_raw(df, tmp_path / "raw", "parquet")
    _fails(engines, engine, config(tmp_path, "parquet"), r"part-0\.parquet, .*part-1\.parquet: duplicate key 3 in column 'id'")


@pytest.mark.parametrize("engine", ENGINES)
def test_nan_and_inf_features_fail_or_are_imputed(engines, engine, tmp_path):
    df = raw_frame()
    df.loc[df["id"] == 11, "b"] = np.inf
    df.loc[df["id"] == 12, "a"] = np.nan
    write_raw(df, tmp_path / "raw", "parquet")
    cfg = config(tmp_path, "parquet")
    _fails(engines, engine, cfg, r"part-0\.parquet: column '(a|b)', key 1[12]: value '?(nan|inf)'?: feature is NaN, inf or null")
    cfg.features.on_invalid_features = "impute"
    prepare(engines[engine], cfg)
    rows = pd.concat(rows_by_split(cfg).values()).set_index("id")
    assert rows.loc[11, "features"][1] == 0.0 and rows.loc[12, "features"][0] == 0.0
    assert np.isfinite(np.stack(rows["features"])).all()
    assert load_manifest(cfg.dataset_dir).imputed_values == {"a": 1, "b": 1}  # recorded (#46)


@pytest.mark.slow
def test_imputed_values_are_counted_in_the_manifest_and_the_training_run(engines, tmp_path):
    """#46: how many values prepare filled in was recorded nowhere."""
    from mlflow.tracking import MlflowClient

    from shardline.training.config import TrackingConfig, TrainingConfig
    from shardline.training.job import run_training

    df = raw_frame()
    df.loc[df["id"].isin([11, 21, 31]), "a"] = np.nan
    df.loc[df["id"] == 12, "b"] = -np.inf
    write_raw(df, tmp_path / "raw", "parquet")
    cfg = config(tmp_path, "parquet", on_invalid_features="impute")
    prepare(engines["dask"], cfg)
    assert load_manifest(cfg.dataset_dir).imputed_values == {"a": 3, "b": 1}
    # An append adds its own to those of the shards kept from before.
    more = raw_frame(rows=100, start=400)
    more.loc[more["id"] == 450, "a"] = None
    write_raw(more, tmp_path / "more", "parquet", files=1)
    prepare(engines["dask"], cfg.model_copy(update={"source": cfg.source.model_copy(
        update={"path": str(tmp_path / "more")})}), append=True)
    assert load_manifest(cfg.dataset_dir).imputed_values == {"a": 4, "b": 1}

    result = run_training(TrainingConfig(launcher="local", world_size=1, epochs=1, batch_size=32, hidden=[8],
                                         checkpoint_dir=str(tmp_path / "ckpt")),
                          TrackingConfig(experiment="imputed"), cfg.dataset_dir, LocalEngine(), register=False)
    assert MlflowClient(result.tracking_uri).get_run(result.run_id).data.params["imputed_values"] == "5"


@pytest.mark.parametrize("engine", ENGINES)
def test_empty_input(engines, engine, tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "empty.csv").write_text("id,a,b,city,y\n")
    _fails(engines, engine, config(tmp_path, "csv"), r"raw: input has no rows")


def test_split_fractions_must_sum_to_one(tmp_path):
    with pytest.raises(ValueError, match="split fractions must sum to 1, got 1.1"):
        PipelineConfig.model_validate({"split": {"train": 0.8, "val": 0.2, "test": 0.1}})


def test_negative_class_label(engines, tmp_path):
    df = raw_frame()
    df.loc[df["id"] == 5, "y"] = -1
    write_raw(df, tmp_path / "raw", "parquet")
    _fails(engines, "dask", config(tmp_path, "parquet"), r"column 'y', key 5: value -1: class label is negative")


def test_json_wrong_type_is_named(engines, tmp_path):
    (tmp_path / "raw").mkdir()
    rows = [{"id": i, "a": 1.0, "b": 2.0, "city": "x", "y": 0} for i in range(20)]
    rows[4]["a"] = "oops"
    (tmp_path / "raw" / "r.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    _fails(engines, "spark", config(tmp_path, "json"), r"r\.jsonl: column 'a', key 4: value 'oops'")


def test_generated_keys_are_stable_and_the_same_on_both_engines(engines, tmp_path):
    df = raw_frame(500).drop(columns=["id"])
    write_raw(df, tmp_path / "raw", "csv")
    got = {}
    for name in ENGINES:
        cfg = config(tmp_path, "csv", generate_key=True)
        cfg.dataset_dir = str(tmp_path / f"ds-{name}")
        prepare(engines[name], cfg)
        got[name] = {s: t["id"].tolist() for s, t in rows_by_split(cfg).items()}
    assert got["spark"] == got["dask"]
    keys = [k for ks in got["spark"].values() for k in ks]
    assert len(set(keys)) == 500 and min(keys) >= 0
    # A duplicated row gets the same key, and is refused as a duplicate.
    write_raw(pd.concat([df, df.iloc[[3]]]), tmp_path / "raw", "csv")
    cfg = config(tmp_path, "csv", generate_key=True)
    cfg.dataset_dir = str(tmp_path / "ds-dup")
    _fails(engines, "dask", cfg, r"duplicate key \d+ in column 'id'")
