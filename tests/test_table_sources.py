"""Delta Lake and Iceberg tables as prepare's input, on Spark and Dask (#47 items 1, 2, 5).

Real tables written by the real libraries: a Delta table by delta-rs with two appends, a
delete and an update (versions 0-3), locally and on the S3 test server; an Iceberg table
in a SQL catalog on SQLite with two snapshots, locally and with its warehouse on the S3
test server. The rows a prepare reads are compared with delta-rs's and pyiceberg's own
reads of the same version, and Spark and Dask write byte-identical shards from it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from shardline.pipelines.checks import check_prepare
from shardline.pipelines.config import PipelineConfig
from shardline.pipelines.delta_source import storage_options
from shardline.foundation.errors import DataError
from shardline.pipelines.manifest import load_manifest
from shardline.pipelines.prepare import prepare
from shardline.foundation import storage

from .test_engines_equal import engine_dirs, prepare_both

ROWS = 1000


def _rows(n: int, start: int = 0) -> pa.Table:
    rng = np.random.default_rng(start)
    ids = np.arange(start, start + n, dtype=np.int64)
    return pa.table({
        "id": ids, "a": rng.normal(size=n), "b": rng.normal(size=n),
        "color": pa.array([["red", "green", "blue"][i % 3] for i in ids]),
        "label": pa.array(ids % 2, pa.int64()),
    })


def delta_table(root: str, opts=None) -> str:
    """Versions 0: 600 rows; 1: +400 (1,000); 2: 100 deleted (900); 3: 50 labels updated."""
    write_deltalake(root, _rows(600), storage_options=opts)
    write_deltalake(root, _rows(400, 600), mode="append", storage_options=opts)
    DeltaTable(root, storage_options=opts).delete("id % 10 = 0")
    DeltaTable(root, storage_options=opts).update(updates={"label": "1 - label"}, predicate="id % 10 = 1")
    return root


def config(dataset_dir, **source) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "dataset_dir": str(dataset_dir), "source": source,
        "features": {"key": "id", "label": "label", "classes": 2},
        "layout": {"world_size": 2, "target_shard_bytes": 8192},
    })


def dataset_rows(dataset_dir: str) -> dict[int, int]:
    """key -> label of every row in the dataset's shards."""
    m = load_manifest(dataset_dir)
    t = pa.concat_tables([pq.read_table(storage.open_input(storage.join(dataset_dir, s.path)))
                          for info in m.splits.values() for s in info.shards])
    return dict(zip(t.column("id").to_pylist(), t.column("label").to_pylist()))


@pytest.fixture(scope="module")
def delta(tmp_path_factory) -> str:
    return delta_table(str(tmp_path_factory.mktemp("delta") / "events"))


def test_delta_latest_and_pinned_versions_on_both_engines(engines, delta, tmp_path):
    got = prepare_both(engines, config(tmp_path / "latest", format="delta", path=delta))
    assert got["spark"] == got["dask"]  # byte-identical shards and manifests
    for name, folder in engine_dirs(config(tmp_path / "latest")).items():
        m = load_manifest(folder)
        assert m.sources == [{"format": "delta", "path": delta, "version": 3}]
        assert sum(i.rows for i in m.splits.values()) == 900
    # The rows equal delta-rs's own read of version 3: deleted rows gone, updated labels new.
    own = DeltaTable(delta).to_pyarrow_table()
    assert dataset_rows(f"{tmp_path}/latest-dask") == dict(zip(own.column("id").to_pylist(),
                                                              own.column("label").to_pylist()))
    for version, rows in ((0, 600), (1, ROWS), (2, 900)):
        cfg = config(tmp_path / f"v{version}", format="delta", path=delta, version=version)
        m = prepare(engines["dask"], cfg)
        assert m.sources[0]["version"] == version and sum(i.rows for i in m.splits.values()) == rows
        own = DeltaTable(delta, version=version).to_pyarrow_table()
        assert dataset_rows(cfg.dataset_dir) == dict(zip(own.column("id").to_pylist(), own.column("label").to_pylist()))


def test_delta_append_adds_what_later_versions_added(engines, delta, tmp_path):
    cfg = config(tmp_path / "ds", format="delta", path=delta, version=0)
    prepare(engines["dask"], cfg)
    m = prepare(engines["dask"], config(tmp_path / "ds", format="delta", path=delta, version=1), append=True)
    assert m.sources[-1] == {"format": "delta", "path": delta, "version": 1, "since_version": 0}
    assert sum(i.rows for i in m.splits.values()) == ROWS  # 600 prepared + the 400 version 1 appended
    own = DeltaTable(delta, version=1).to_pyarrow_table()
    assert dataset_rows(cfg.dataset_dir) == dict(zip(own.column("id").to_pylist(), own.column("label").to_pylist()))
    # Version 2 deleted rows, and the table keeps no change data: refused, saying what to do.
    before = sorted(p.name for p in (tmp_path / "ds").iterdir())
    with pytest.raises(DataError, match=r"version 2 removed or rewrote rows .*enableChangeDataFeed.*--refit"):
        check_prepare(config(tmp_path / "ds", format="delta", path=delta), append=True)
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == before
    # --refit reads the newest version whole, in place of the versions the dataset held.
    m = prepare(engines["dask"], config(tmp_path / "ds", format="delta", path=delta), append=True, refit=True)
    assert [s["version"] for s in m.sources] == [3] and sum(i.rows for i in m.splits.values()) == 900


def test_delta_change_data_gives_an_append_its_inserted_rows(engines, tmp_path):
    root = str(tmp_path / "cdf")
    write_deltalake(root, _rows(300), configuration={"delta.enableChangeDataFeed": "true"})
    prepare(engines["dask"], config(tmp_path / "ds", format="delta", path=root))
    # A MERGE that inserts new keys rewrites nothing the dataset holds: its change data
    # holds inserts only.
    (DeltaTable(root).merge(_rows(100, 300), predicate="s.id = t.id", source_alias="s", target_alias="t")
     .when_not_matched_insert_all().execute())
    m = prepare(engines["dask"], config(tmp_path / "ds", format="delta", path=root), append=True)
    assert sum(i.rows for i in m.splits.values()) == 400
    DeltaTable(root).delete("id = 5")
    with pytest.raises(DataError, match="version 2 deleted rows the dataset holds .*change data"):
        check_prepare(config(tmp_path / "ds", format="delta", path=root), append=True)


def test_delta_on_s3_both_engines(engines, tmp_path, bucket):
    root = f"{bucket}/events"
    delta_table(root, storage_options(root))
    cfg = config(f"{bucket}/ds", format="delta", path=root, version=2)
    dirs = {}
    for name, engine in engines.items():
        c = cfg.model_copy(update={"dataset_dir": f"{bucket}/ds-{name}"})
        m = prepare(engine, c)
        assert m.sources == [{"format": "delta", "path": root, "version": 2}]
        dirs[name] = dataset_rows(c.dataset_dir)
    own = DeltaTable(root, version=2, storage_options=storage_options(root)).to_pyarrow_table()
    assert dirs["spark"] == dirs["dask"] == dict(zip(own.column("id").to_pylist(), own.column("label").to_pylist()))


def _iceberg(tmp_path, warehouse: str, props: dict | None = None) -> tuple[dict, list[int]]:
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}", "warehouse": warehouse, **(props or {})}
    cat = SqlCatalog("default", **{k: v for k, v in catalog.items() if k != "type"})
    cat.create_namespace("shop")
    table = cat.create_table("shop.orders", schema=_rows(1).schema)
    table.append(_rows(600))
    table.append(_rows(400, 600))
    return catalog, [s.snapshot_id for s in cat.load_table("shop.orders").snapshots()]


def test_iceberg_snapshots_on_both_engines(engines, tmp_path):
    catalog, (first, second) = _iceberg(tmp_path, f"file://{tmp_path / 'warehouse'}")
    got = prepare_both(engines, config(tmp_path / "ice", format="iceberg", table="shop.orders", catalog=catalog))
    assert got["spark"] == got["dask"]
    m = load_manifest(f"{tmp_path}/ice-spark")
    assert m.sources[0]["snapshot_id"] == second and sum(i.rows for i in m.splits.values()) == ROWS
    m = prepare(engines["dask"], config(tmp_path / "first", format="iceberg", table="shop.orders",
                                        catalog=catalog, snapshot_id=first))
    assert sum(i.rows for i in m.splits.values()) == 600
    m = prepare(engines["dask"], config(tmp_path / "first", format="iceberg", table="shop.orders",
                                        catalog=catalog), append=True)
    assert m.sources[-1]["since_snapshot_id"] == first and sum(i.rows for i in m.splits.values()) == ROWS


def test_iceberg_warehouse_on_s3(engines, tmp_path, bucket):
    from .fixtures_s3 import AWS_ENV, S3_ENDPOINT

    s3 = {"s3.endpoint": S3_ENDPOINT, "s3.access-key-id": AWS_ENV["AWS_ACCESS_KEY_ID"],
          "s3.secret-access-key": AWS_ENV["AWS_SECRET_ACCESS_KEY"], "s3.region": "us-east-1"}
    catalog, _ = _iceberg(tmp_path, f"{bucket}/warehouse", s3)
    m = prepare(engines["spark"], config(tmp_path / "ice", format="iceberg", table="shop.orders", catalog=catalog))
    assert sum(i.rows for i in m.splits.values()) == ROWS
    assert "secret" not in str(m.sources)  # the catalog is named by its uri, never its credentials


def test_the_mlflow_run_names_the_tables_and_their_versions(tmp_path, tracking_uri):
    from types import SimpleNamespace

    import mlflow

    from shardline.training.tracking import log_dataset_input

    manifest = SimpleNamespace(
        splits={"train": SimpleNamespace(shards=[SimpleNamespace(sha256="abc")])}, sequence=2,
        sources=[{"format": "delta", "path": "/data/events", "version": 3},
                 {"format": "iceberg", "table": "shop.orders", "catalog": "sqlite:////c.db", "snapshot_id": 42}])
    mlflow.set_experiment("table-inputs")
    with mlflow.start_run() as run:
        log_dataset_input(manifest, str(tmp_path / "dataset"))
    inputs = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
    named = {i.dataset.name: next(t.value for t in i.tags if t.key == "mlflow.data.context") for i in inputs}
    assert named == {f"{tmp_path / 'dataset'}@2": "training", "delta:/data/events@v3": "source",
                     "iceberg:shop.orders@42": "source"}


def test_an_iceberg_column_renamed_after_the_files_were_written_is_read_by_its_field_id(tmp_path):
    """The data files still name it `a`; the table calls it `alpha` now: tasks read it by id."""
    from pyiceberg.catalog.sql import SqlCatalog

    from shardline.pipelines.config import SourceConfig
    from shardline.pipelines.raw import plan_units, read_unit
    from shardline.pipelines.tables import read_input

    catalog, _ = _iceberg(tmp_path, f"file://{tmp_path / 'warehouse'}")
    table = SqlCatalog("default", uri=catalog["uri"], warehouse=catalog["warehouse"]).load_table("shop.orders")
    with table.update_schema() as update:
        update.rename_column("a", "alpha")
    ti = read_input(SourceConfig(format="iceberg", table="shop.orders", catalog=catalog))
    assert "alpha" in ti.schema.names and "a" not in ti.schema.names
    got = pa.concat_tables(t for u in plan_units(ti.files) for t in read_unit(u, ["id", "alpha"], ","))
    own = table.refresh().scan().to_arrow()
    assert dict(zip(got.column("id").to_pylist(), got.column("alpha").to_pylist())) == \
        dict(zip(own.column("id").to_pylist(), own.column("alpha").to_pylist()))
    assert got.column("alpha").null_count == 0
