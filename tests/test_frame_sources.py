"""Spark catalog tables, Spark SQL queries and DataFrames as prepare's input (#47 item 1).

A table written to the session's Spark catalog (`saveAsTable`), a query over it, and
DataFrames handed to `shardline.prepare(source=df)` on Spark and on Dask: each is staged
as Parquet in the dataset's `_staging/` folder by the engine's tasks, prepared, and the
staging removed; the manifest records the table, the query or the DataFrame.
"""

from __future__ import annotations

import dask.dataframe as dd
import pytest

import shardline
from shardline.pipelines.checks import check_prepare
from shardline.foundation.errors import ConfigError
from shardline.pipelines.manifest import load_manifest
from shardline.pipelines.prepare import prepare

from .test_table_sources import _rows, config, dataset_rows

TABLE = "shardline_orders"


@pytest.fixture(scope="module")
def catalog_table(spark):
    spark.createDataFrame(_rows(500).to_pandas()).write.mode("overwrite").saveAsTable(TABLE)
    yield TABLE
    spark.sql(f"DROP TABLE IF EXISTS {TABLE}")


def test_a_spark_catalog_table_and_a_query(engines, catalog_table, tmp_path):
    m = prepare(engines["spark"], config(tmp_path / "t", format="table", table=catalog_table))
    assert m.sources == [{"format": "table", "table": catalog_table}]
    assert sorted(dataset_rows(str(tmp_path / "t"))) == list(range(500))
    query = f"SELECT * FROM {catalog_table} WHERE id < 200"
    m = prepare(engines["spark"], config(tmp_path / "q", format="table", query=query))
    assert m.sources == [{"format": "table", "query": query}]
    assert sorted(dataset_rows(str(tmp_path / "q"))) == list(range(200))
    for folder in ("t", "q"):  # the staged snapshot is gone once committed
        assert not (tmp_path / folder / "_staging").exists()


@pytest.mark.parametrize("source, message", [
    ({"query": "SELEC id FROM nowhere"}, "pipelines.source.query: does not parse as Spark SQL"),
    ({"table": "no_such_table"}, "pipelines.source.table = 'no_such_table': no such table or view"),
    ({"query": "SELECT id, a FROM shardline_orders"}, "column 'label' not found (its columns: id, a)"),
])
def test_a_bad_table_or_query_is_one_line_before_any_job(engines, catalog_table, tmp_path, source, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare(engines["spark"], config(tmp_path / "bad", format="table", **source))
    assert not (tmp_path / "bad").exists()  # the lease made the folder, and took it away with it


def test_a_spark_table_on_dask_is_refused_before_anything_starts(tmp_path):
    cfg = config(tmp_path / "ds", format="table", table=TABLE).model_copy(update={"engine": "dask"})
    with pytest.raises(ConfigError, match="needs pipelines.engine = 'spark'"):
        check_prepare(cfg)


def _job(tmp_path, folder: str) -> dict:
    return {"pipelines": {"dataset_dir": str(tmp_path / folder),
                          "features": {"key": "id", "label": "label", "classes": 2},
                          "layout": {"world_size": 2, "target_shard_bytes": 8192}}}


def test_prepare_takes_a_spark_dataframe(spark, tmp_path):
    df = spark.createDataFrame(_rows(300).to_pandas()).repartition(3)
    r = shardline.prepare(_job(tmp_path, "ds"), source=df)
    assert r.engine == "spark" and load_manifest(r.dataset_dir).sources == [{"format": "dataframe", "engine": "spark"}]
    assert sorted(dataset_rows(r.dataset_dir)) == list(range(300))


def test_prepare_takes_a_dask_dataframe(dask_client, tmp_path):
    ddf = dd.from_pandas(_rows(300).to_pandas(), npartitions=3)
    r = shardline.prepare(_job(tmp_path, "ds"), source=ddf, client=dask_client)
    assert r.engine == "dask" and load_manifest(r.dataset_dir).sources == [{"format": "dataframe", "engine": "dask"}]
    assert sorted(dataset_rows(r.dataset_dir)) == list(range(300))
    with pytest.raises(ConfigError, match="a dask DataFrame, but pipelines.engine = 'spark'"):
        shardline.prepare({**_job(tmp_path, "other"), "pipelines": {**_job(tmp_path, "other")["pipelines"],
                                                                    "engine": "spark"}}, source=ddf)
