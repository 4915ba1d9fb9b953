"""Scores keep the input's key column name (#53.19): a model trained on rows keyed by `id`
scores into files, a Delta table and `--status` with `id`, so scores join back to the
input with no rename; an output that already holds scores keyed `key` (written before
this rule) keeps `key` for every later run, incremental and Delta ones too.

Full tier (marker `slow`): prepares and trains a model of its own (the session's is
keyed `key`), then scores six times.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from shardline.serving.delta_output import SCORES
from shardline.serving.ledger import LEDGER, all_scores
from shardline.serving.status import output_status

from .serving_helpers import TRAINING, raw_table, read_scores, score, write_raw

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def keyed_by_id(dask_client, prepared, tracking_uri, tmp_path_factory):
    """(model URI, the raw rows keyed by `id`): the session's rows with their key renamed,
    prepared on Dask and trained on 1 rank for 1 epoch."""
    import shardline
    from shardline.pipelines.manifest import load_manifest
    from shardline.training.config import TrackingConfig, TrainingConfig
    from shardline.engines import LocalEngine
    from shardline.training.job import run_training

    tmp = tmp_path_factory.mktemp("keyed-by-id")
    rows = raw_table(prepared)
    rows = rows.rename_columns(["id" if n == "key" else n for n in rows.column_names])
    write_raw(rows, tmp / "raw", files=2)
    spec = load_manifest(prepared.dataset_dir).feature_spec
    cfg = {"pipelines": {"dataset_dir": str(tmp / "dataset"), "source": {"format": "parquet", "path": str(tmp / "raw")},
                         "features": {"key": "id", "label": spec.label, "numeric": spec.numeric,
                                      "categorical": spec.categorical},
                         "layout": {"world_size": 2}},
           "tracking": {"tracking_uri": tracking_uri}}
    prepared_id = shardline.prepare(cfg, client=dask_client)
    trained = run_training(TrainingConfig(**TRAINING), TrackingConfig(experiment="keyed-by-id",
                                                                      registered_model="keyed-by-id"),
                           prepared_id.dataset_dir, LocalEngine())
    return trained.model_uri, rows


def test_scores_files_delta_and_status_name_the_key_as_the_input_does(dask_client, keyed_by_id, tracking_uri,
                                                                      tmp_path):
    uri, rows = keyed_by_id
    write_raw(rows, tmp_path / "in", files=2)
    out = tmp_path / "scores"
    score("dask", dask_client, uri, tracking_uri, str(tmp_path / "in"), str(out), batch_size=256)
    got = read_scores(out)
    assert got.column_names[0] == "id" and "key" not in got.column_names
    assert sorted(got.column("id").to_pylist()) == sorted(rows.column("id").to_pylist())
    (scores,) = all_scores(str(out))
    assert {e["key_column"] for e in scores.entries.values()} == {"id"}
    assert output_status(str(out)).versions[0].rows == rows.num_rows

    table = tmp_path / "table"
    score("dask", dask_client, uri, tracking_uri, str(tmp_path / "in"), str(table), batch_size=256,
          output_format="delta")
    scored = DeltaTable(str(table)).to_pyarrow_table()
    assert scored.column_names[0] == "id" and "key" not in scored.column_names
    assert sorted(scored.column("id").to_pylist()) == sorted(rows.column("id").to_pylist())


def _as_written_before(out) -> None:
    """An output as shardline wrote it before scores kept the input's key name: files keyed
    `key`, ledger entries without `key_column`."""
    (scores,) = all_scores(str(out))
    for unit_id, e in scores.entries.items():
        path = f"{scores.dir}/{e['output']}"
        t = pq.read_table(path)
        pq.write_table(t.rename_columns(["key" if n == "id" else n for n in t.column_names]), path)
        old = {k: v for k, v in e.items() if k != "key_column"}
        with open(f"{scores.dir}/{LEDGER}/{unit_id}.json", "w") as f:
            json.dump(old, f, sort_keys=True)


def test_an_output_keyed_key_before_keeps_key_in_incremental_and_delta_runs(dask_client, keyed_by_id,
                                                                            tracking_uri, tmp_path):
    import shutil

    uri, rows = keyed_by_id
    first, more = rows.slice(0, rows.num_rows // 2), rows.slice(rows.num_rows // 2)
    write_raw(first, tmp_path / "in", files=1)
    out = tmp_path / "scores"
    score("dask", dask_client, uri, tracking_uri, str(tmp_path / "in"), str(out), batch_size=256)
    _as_written_before(out)
    # A Delta output whose units were scored before too (its table to be created by the next run).
    table = tmp_path / "table"
    shutil.copytree(out, table / SCORES)

    write_raw(more, tmp_path / "in", files=1, start=1)
    score("dask", dask_client, uri, tracking_uri, str(tmp_path / "in"), str(out), batch_size=256, incremental=True)
    got = read_scores(out)  # one schema across the old file and the new one
    assert got.column_names[0] == "key" and "id" not in got.column_names
    assert sorted(got.column("key").to_pylist()) == sorted(rows.column("id").to_pylist())
    (scores,) = all_scores(str(out))
    assert sorted(e.get("key_column", "-") for e in scores.entries.values()) == ["-", "key"]
    status = output_status(str(out)).versions[0]
    assert (status.units, status.rows) == (2, rows.num_rows)

    # The incremental run creates the table keyed `key` (its ledger's name) with both units;
    # --force then discards every ledger entry, and the table's schema keeps `key`.
    for force in (False, True):
        score("dask", dask_client, uri, tracking_uri, str(tmp_path / "in"), str(table), batch_size=256,
              incremental=not force, force=force, output_format="delta")
        scored = pa.table(DeltaTable(str(table)).to_pyarrow_table())
        assert DeltaTable(str(table)).schema().fields[0].name == "key" and "id" not in scored.column_names
        assert sorted(scored.column("key").to_pylist()) == sorted(rows.column("id").to_pylist())
