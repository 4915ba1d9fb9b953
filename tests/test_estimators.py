"""The engines' own conventions (#36.5): a Spark ML Estimator/Model pair and a Dask
fit/predict estimator, each fitting on a DataFrame of the caller's session or client."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

ROWS = 2000


def _frame(seed: int = 3) -> pd.DataFrame:
    """A learnable two-class problem with a text column: label = [x0 + x1 > 0]."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 3))
    return pd.DataFrame({
        "x0": x[:, 0], "x1": x[:, 1], "x2": x[:, 2],
        "color": rng.choice(["red", "green", "blue"], ROWS),
        "label": (x[:, 0] + x[:, 1] > 0).astype(np.int64),
    })


def _config(tmp_path) -> dict:
    return {
        "pipelines": {"dataset_dir": str(tmp_path / "dataset"), "source": {"path": str(tmp_path / "raw")},
                      "layout": {"world_size": 2}},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "registered_model": "estimator"},
        "training": {"world_size": 2, "batch_size": 64, "epochs": 4, "lr": 0.01,
                     "checkpoint_dir": str(tmp_path / "ckpt")},
    }


@pytest.mark.slow
def test_spark_estimator_fits_and_transforms(spark, tmp_path):
    from pyspark.ml import Estimator, Model

    from shardline.spark import ShardlineEstimator, ShardlineModel

    pdf = _frame()
    df = spark.createDataFrame(pdf)
    est = ShardlineEstimator(_config(tmp_path), label_col="label")
    assert isinstance(est, Estimator)
    model = est.fit(df)
    assert isinstance(model, ShardlineModel) and isinstance(model, Model)
    assert model.model_uri == "models:/estimator/1"
    assert model.trained.launcher == "spark"  # the DataFrame's session, none started
    spec = model.prepared.manifest.feature_spec
    assert spec.numeric == ["x0", "x1", "x2"] and spec.categorical == ["color"] and spec.key == "shardline_key"
    assert sum(s.rows for s in model.prepared.manifest.splits.values()) == ROWS

    scored = model.transform(df).toPandas()
    assert list(scored.columns) == [*pdf.columns, "prediction", "probability"]
    assert len(scored) == ROWS
    probs = np.array(scored["probability"].tolist())
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    assert (probs.argmax(1) == scored["prediction"]).all()
    merged = scored.sort_values(["x0", "x1"]).reset_index(drop=True)
    truth = pdf.sort_values(["x0", "x1"]).reset_index(drop=True)
    assert (merged["label"] == truth["label"]).all()
    accuracy = (merged["prediction"] == truth["label"]).mean()
    assert accuracy > 0.9, accuracy  # a linear boundary; chance is 0.5


@pytest.mark.slow
def test_dask_estimator_fits_and_predicts(dask_client, tmp_path):
    import dask.dataframe as dd

    from shardline.dask import ShardlineEstimator

    pdf = _frame(seed=4)
    ddf = dd.from_pandas(pdf, npartitions=2)
    est = ShardlineEstimator(_config(tmp_path), label_col="label", client=dask_client).fit(ddf)
    assert est.model_uri == "models:/estimator/1" and est.trained_.launcher == "dask"
    assert est.prepared_.engine == "dask"
    assert sum(s.rows for s in est.prepared_.manifest.splits.values()) == ROWS

    pred = est.predict(ddf)
    assert isinstance(pred, dd.Series)
    got = pred.compute()
    assert got.index.equals(pdf.index) and got.dtype == np.int64
    accuracy = (got == pdf["label"]).mean()
    assert accuracy > 0.9, accuracy
    probs = est.predict_proba(ddf).compute()
    assert list(probs.columns) == [0, 1]
    np.testing.assert_allclose(probs.to_numpy().sum(1), 1.0, atol=1e-5)
    assert (probs.to_numpy().argmax(1) == got.to_numpy()).all()
    assert dask_client.status == "running"


CONNECT_FIT = """
import json, sys
import pandas as pd
from pyspark.sql import SparkSession

from shardline.spark import ShardlineEstimator

url, data, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spark = SparkSession.builder.remote(url).getOrCreate()
pdf = pd.read_parquet(data)
df = spark.createDataFrame(pdf)
model = ShardlineEstimator(config, label_col="label").fit(df)
scored = model.transform(df).toPandas()
print(json.dumps({
    "session": type(spark).__module__, "model_uri": model.model_uri, "launcher": model.trained.launcher,
    "columns": list(scored.columns), "rows": len(scored),
    "accuracy": float((scored["prediction"] == scored["label"]).mean()),
}))
"""


@pytest.mark.slow
def test_spark_estimator_on_spark_connect(connect_server, connect_cli, tmp_path):
    """The same pair on a Spark Connect session: its executors have shardline only as the
    client's artifacts, so fit and transform ship all they run. Not in this process, which
    holds the classic session: in the session's Connect client process (`connect_cli`, as
    `python -c`), whose session, shipped code and server-side Python workers the CLI's
    Connect commands share, as a notebook user's fit after a CLI run would."""
    import json

    data = tmp_path / "frame.parquet"
    _frame().to_parquet(data)
    proc = connect_cli.python(CONNECT_FIT, connect_server.url, str(data), json.dumps(_config(tmp_path)),
                              cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:] + connect_server.log_tail()
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["session"].startswith("pyspark.sql.connect")
    assert out["model_uri"] == "models:/estimator/1" and out["launcher"] == "spark"
    assert out["columns"] == ["x0", "x1", "x2", "color", "label", "prediction", "probability"]
    assert out["rows"] == ROWS and out["accuracy"] > 0.9, out
