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

    # Saved and loaded: the registry URI and settings, no weights; the same predictions.
    model.setPredictionCol("pred").setProbabilityCol("prob")
    model.save(str(tmp_path / "saved"))
    loaded = ShardlineModel.load(str(tmp_path / "saved"))
    assert not list((tmp_path / "saved").rglob("*.safetensors")) and not list((tmp_path / "saved").rglob("*.pt"))
    assert loaded.uid == model.uid and loaded.model_uri == "models:/estimator/1"
    assert (loaded.getPredictionCol(), loaded.getProbabilityCol(), loaded.getLabelCol()) == ("pred", "prob", "label")
    again = loaded.transform(df).toPandas().sort_values(["x0", "x1"]).reset_index(drop=True)
    assert (again["pred"] == merged["prediction"]).all()
    np.testing.assert_allclose(np.array(again["prob"].tolist()), np.array(merged["probability"].tolist()),
                               atol=1e-6)


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

    # A version gone from the registry is one line from the driver (the scoring job's model
    # check, serving.job.ScoringJob.check_model), before any worker tries to load it.
    import dataclasses

    from shardline.foundation.errors import ShardlineError

    est.fitted_ = dataclasses.replace(est.fitted_, model_uri="models:/estimator/99")
    with pytest.raises(ShardlineError, match=r"model models:/estimator/99: 'estimator' has no version 99"):
        est.predict(pdf)


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
# Saved and loaded on Connect (DataFrame writes only): alone, overwritten, and in a PipelineModel.
from pyspark.ml import PipelineModel
from shardline.spark import ShardlineModel
saved = sys.argv[4]
model.save(saved + "/model")
model.write().overwrite().save(saved + "/model")
PipelineModel([model]).save(saved + "/pipeline")
loaded = ShardlineModel.load(saved + "/model")
stage = PipelineModel.load(saved + "/pipeline").stages[0]
key = ["x0", "x1"]
ordered = scored.sort_values(key).reset_index(drop=True)
same = [bool((m.transform(df).toPandas().sort_values(key).reset_index(drop=True)["prediction"]
              == ordered["prediction"]).all()) for m in (loaded, stage)]
print(json.dumps({
    "session": type(spark).__module__, "model_uri": model.model_uri, "launcher": model.trained.launcher,
    "columns": list(scored.columns), "rows": len(scored),
    "accuracy": float((scored["prediction"] == scored["label"]).mean()),
    "loaded": [loaded.model_uri, stage.model_uri], "same": same,
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
                              str(tmp_path / "saved"), cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:] + connect_server.log_tail()
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["session"].startswith("pyspark.sql.connect")
    assert out["model_uri"] == "models:/estimator/1" and out["launcher"] == "spark"
    assert out["columns"] == ["x0", "x1", "x2", "color", "label", "prediction", "probability"]
    assert out["rows"] == ROWS and out["accuracy"] > 0.9, out
    assert out["loaded"] == ["models:/estimator/1"] * 2 and out["same"] == [True, True], out


def _small(tmp_path, rows: int = 600, **training) -> tuple[pd.DataFrame, dict]:
    """A small fit: few rows, one epoch (fitting trains and registers a real model)."""
    cfg = _config(tmp_path)
    cfg["training"] |= {"epochs": 1, **training}
    return _frame().head(rows), cfg


def test_dask_estimator_params_follow_sklearn(dask_client, tmp_path):
    """get_params/set_params from __init__'s signature, clone, the fitted-state check and the
    estimator kind, without a fit."""
    from sklearn.base import clone, is_classifier, is_regressor
    from sklearn.exceptions import NotFittedError
    from sklearn.utils.validation import check_is_fitted

    from shardline.dask import ShardlineEstimator
    from shardline.foundation.errors import ShardlineError

    config = _config(tmp_path)
    est = ShardlineEstimator(config, ["training.epochs=1"], label_col="label", feature_cols=["x0", "x1"],
                             client=dask_client)
    params = est.get_params()
    tuned = ("model", "model_args", "hidden", "strategy", "epochs", "batch_size", "lr", "weight_decay",
             "lr_schedule", "warmup_steps", "seed")  # training settings a search tunes (#53.23): None, the config's
    assert params == {"config": config, "overrides": ["training.epochs=1"], "label_col": "label",
                      "feature_cols": ["x0", "x1"], "key_col": None, "raw_dir": None, "client": dask_client,
                      **dict.fromkeys(tuned)}
    assert all(params[k] is getattr(est, k) for k in params)  # stored as given, under its own name
    assert est.set_params(key_col="id", raw_dir=str(tmp_path / "raw"), lr=1e-3, model_args={"w": 2}) is est
    assert (est.key_col, est.get_params()["raw_dir"], est.lr, est.model_args) == ("id", str(tmp_path / "raw"),
                                                                                 1e-3, {"w": 2})
    with pytest.raises(ValueError, match="Invalid parameter 'epochz' for estimator ShardlineEstimator"):
        est.set_params(epochz=3)
    # A setting given twice, or a bad value, is refused at fit before anything is written.
    X, y = _frame().head(20).drop(columns="label"), _frame().head(20)["label"]
    with pytest.raises(ShardlineError, match="epochs = 2 and overrides set training.epochs too: give it once"):
        clone(est).set_params(epochs=2).fit(X, y)
    with pytest.raises(ShardlineError, match="lr = 0: Input should be greater than 0"):
        clone(est).set_params(lr=0).fit(X, y)
    assert not (tmp_path / "raw").exists()
    est.set_params(lr=None, model_args=None)

    twin = clone(est)
    assert type(twin) is ShardlineEstimator and twin is not est
    assert twin.get_params(deep=False) == est.get_params(deep=False)
    assert twin.config is not est.config and twin.feature_cols is not est.feature_cols  # deep copies
    assert twin.client is dask_client  # a connection is shared, not copied
    twin.set_params(label_col="y")
    assert est.label_col == "label"
    assert ShardlineEstimator(**twin.get_params()).get_params() == twin.get_params()
    assert "ShardlineEstimator(" in repr(est) and "key_col='id'" in repr(est)

    with pytest.raises(NotFittedError):
        check_is_fitted(est)
    with pytest.raises(ShardlineError, match="not fitted yet"):
        est.predict(_frame().head(5))
    assert is_classifier(est) and not is_regressor(est)  # the config's task: classification
    assert is_regressor(ShardlineEstimator(config, ["pipelines.features.task=regression"]))


def test_spark_params_setters_defaults_and_save(spark, tmp_path):
    """Every setting a Param with a default and a setter; the estimator saved and loaded; a
    model's saved tracking URI with its password masked, refused at transform until set again."""
    from shardline.estimators import Fitted
    from shardline.foundation.errors import ShardlineError
    from shardline.spark import ShardlineEstimator, ShardlineModel

    est = ShardlineEstimator()
    defaults = {p.name: est.getOrDefault(p) for p in est.params}
    tuned = {"model", "modelArgs", "hidden", "strategy", "epochs", "batchSize", "lr", "weightDecay", "lrSchedule",
             "warmupSteps", "seed"}  # the training settings a search tunes (#53.23): None, the config's
    assert defaults == {"config": None, "overrides": [], "labelCol": "label", "featureCols": None, "keyCol": None,
                        "rawDir": None, "predictionCol": "prediction", "probabilityCol": "probability",
                        **dict.fromkeys(tuned)}
    assert not any(est.isSet(p) for p in est.params)  # the config's label wins over labelCol's default
    config = _config(tmp_path)
    for setter, value in [("setConfig", config), ("setOverrides", ["training.epochs=1"]), ("setLabelCol", "y"),
                          ("setFeatureCols", ["x0", "x1"]), ("setKeyCol", "id"), ("setRawDir", str(tmp_path)),
                          ("setPredictionCol", "pred"), ("setProbabilityCol", "prob")]:
        assert getattr(est, setter)(value) is est
    assert (est.getConfig(), est.getOverrides(), est.getLabelCol(), est.getFeatureCols(), est.getKeyCol(),
            est.getRawDir(), est.getPredictionCol(), est.getProbabilityCol()) == (
        config, ["training.epochs=1"], "y", ["x0", "x1"], "id", str(tmp_path), "pred", "prob")
    # The keyword arguments set the same Params.
    kw = ShardlineEstimator(config, ["training.epochs=1"], label_col="y", feature_cols=["x0", "x1"], key_col="id",
                            raw_dir=str(tmp_path), prediction_col="pred", probability_col="prob")
    assert {p.name: kw.getOrDefault(p) for p in kw.params} == {p.name: est.getOrDefault(p) for p in est.params}
    # The training settings: keywords, Params pyspark.ml's tuning takes, saved with the rest.
    est = ShardlineEstimator(config, lr=1e-3, model_args={"width": 4}, hidden=[8], batch_size=32)
    assert (est.getOrDefault(est.lr), est.getOrDefault(est.modelArgs), est.getOrDefault(est.batchSize)) == (
        1e-3, {"width": 4}, 32)
    from pyspark.ml.tuning import ParamGridBuilder

    grid = ParamGridBuilder().addGrid(est.lr, [1e-3, 3e-3]).addGrid(est.epochs, [1, 2]).build()
    assert [est.copy(m).getOrDefault(est.lr) for m in grid] == [1e-3, 1e-3, 3e-3, 3e-3]
    # A setting given twice, or a bad value, is refused at fit before anything runs.
    df = spark.createDataFrame(_frame().head(20))
    with pytest.raises(ShardlineError, match=r"lr = 0.001 and overrides set training.lr too: give it once"):
        est.copy({est.overrides: ["training.lr=0.01"]}).fit(df)
    with pytest.raises(ShardlineError, match=r"batchSize = 0: Input should be greater than or equal to 1"):
        est.copy({est.batchSize: 0}).fit(df)
    assert not (tmp_path / "raw").exists()

    est.save(str(tmp_path / "est"))
    back = ShardlineEstimator.load(str(tmp_path / "est"))
    assert back.uid == est.uid
    assert {p.name: back.getOrDefault(p) for p in back.params} == {p.name: est.getOrDefault(p) for p in est.params}
    est.write().overwrite().save(str(tmp_path / "est"))  # overwrite goes through pyspark's own check
    import shardline

    with pytest.raises(ShardlineError, match="save: config is a ShardlineConfig"):
        ShardlineEstimator(shardline.load_config(config)).save(str(tmp_path / "est-object"))
    assert not (tmp_path / "est-object").exists()

    # What a fitted model saves: its Params (no weights); a secret in the tracking URI is masked.
    fitted = Fitted("models:/estimator/3", "postgresql://user:s3cret@db.example/mlflow", "run-id",
                    ('{"spec": 1}', '{"stats": 2}', 7), True)
    model = ShardlineModel(fitted)
    model.save(str(tmp_path / "model"))
    saved = "".join(p.read_text() for p in (tmp_path / "model").rglob("part-*"))
    assert "s3cret" not in saved and "postgresql://user:***@db.example/mlflow" in saved
    loaded = ShardlineModel.load(str(tmp_path / "model"))
    assert loaded.fitted == Fitted("models:/estimator/3", "postgresql://user:***@db.example/mlflow", "run-id",
                                   ('{"spec": 1}', '{"stats": 2}', 7), True)
    with pytest.raises(ShardlineError, match="had its secret masked: set it with setTrackingUri"):
        loaded.transform(spark.range(1))
    assert loaded.setTrackingUri(fitted.tracking_uri).fitted == fitted
    assert model.fitted == fitted  # the model itself keeps its URI whole
    with pytest.raises(ShardlineError, match="holds no model"):
        ShardlineModel().model_uri


@pytest.mark.slow
def test_spark_estimator_in_a_pipeline(spark, tmp_path):
    """Inside a pyspark.ml Pipeline (after a SQLTransformer): fit, save the PipelineModel, load
    it, transform: the same predictions."""
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import SQLTransformer

    from shardline.spark import ShardlineEstimator, ShardlineModel

    pdf, config = _small(tmp_path)
    df = spark.createDataFrame(pdf)
    pipeline = Pipeline(stages=[
        SQLTransformer(statement="SELECT *, x0 + x1 AS x01 FROM __THIS__"),
        ShardlineEstimator(config).setLabelCol("label").setFeatureCols(["x01", "x2", "color"])
        .setPredictionCol("pred"),
    ])
    fitted = pipeline.fit(df)
    model = fitted.stages[1]
    assert isinstance(model, ShardlineModel) and model.model_uri == "models:/estimator/1"
    assert model.prepared.manifest.feature_spec.numeric == ["x01", "x2"]
    scored = fitted.transform(df).toPandas()
    assert list(scored.columns) == [*pdf.columns, "x01", "pred", "probability"] and len(scored) == len(pdf)

    fitted.save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    assert [type(s).__name__ for s in loaded.stages] == ["SQLTransformer", "ShardlineModel"]
    assert loaded.stages[1].model_uri == "models:/estimator/1" and loaded.stages[1].getPredictionCol() == "pred"
    again = loaded.transform(df).toPandas()
    key = ["x0", "x1"]
    a, b = (t.sort_values(key).reset_index(drop=True) for t in (scored, again))
    assert (a["pred"] == b["pred"]).all()
    np.testing.assert_allclose(np.array(a["probability"].tolist()), np.array(b["probability"].tolist()), atol=1e-6)
    # The unfitted Pipeline saves and loads too (its estimator's Params).
    pipeline.save(str(tmp_path / "unfitted"))
    stages = Pipeline.load(str(tmp_path / "unfitted")).getStages()
    assert stages[1].getFeatureCols() == ["x01", "x2", "color"] and stages[1].getConfig() == config


@pytest.mark.slow
def test_dask_estimator_on_pandas_with_named_classes(dask_client, tmp_path):
    """fit(X, y) on pandas, labels named in pipelines.features.classes: classes_ are the
    names, predict gives names, pandas in gives numpy out, score is sklearn's accuracy."""
    import dask.dataframe as dd
    from sklearn.base import clone
    from sklearn.metrics import accuracy_score

    from shardline.dask import ShardlineEstimator

    pdf, config = _small(tmp_path)
    config["pipelines"]["features"] = {"classes": ["neg", "pos"]}
    X, y = pdf.drop(columns="label"), np.where(pdf["label"] == 1, "pos", "neg")
    est = ShardlineEstimator(config, client=dask_client)
    assert est.fit(X, y) is est
    assert est.model_uri == "models:/estimator/1" and est.prepared_.manifest.feature_spec.label == "label"
    assert list(est.classes_) == ["neg", "pos"]
    assert est.n_features_in_ == 4 and list(est.feature_names_in_) == ["x0", "x1", "x2", "color"]

    pred = est.predict(X)
    assert isinstance(pred, np.ndarray) and pred.shape == (len(X),) and set(pred) <= {"neg", "pos"}
    probs = est.predict_proba(X)
    assert isinstance(probs, np.ndarray) and probs.shape == (len(X), 2)
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    assert (est.classes_[probs.argmax(1)] == pred).all()
    assert est.score(X, y) == pytest.approx(accuracy_score(y, pred))
    weights = np.linspace(0.5, 2.0, len(X))
    assert est.score(X, y, sample_weight=weights) == pytest.approx(accuracy_score(y, pred, sample_weight=weights))

    ddf = dd.from_pandas(X.assign(label=y), npartitions=2)
    dpred = est.predict(ddf)
    assert isinstance(dpred, dd.Series) and (dpred.compute().to_numpy() == pred).all()
    dprobs = est.predict_proba(ddf)
    assert isinstance(dprobs, dd.DataFrame) and list(dprobs.columns) == ["neg", "pos"]
    np.testing.assert_allclose(dprobs.compute().to_numpy(), probs, atol=1e-6)
    assert est.score(ddf) == pytest.approx(accuracy_score(y, pred))  # the label column of X

    assert not hasattr(clone(est), "classes_")  # a clone is unfitted


@pytest.mark.slow
def test_dask_estimator_regression_on_dask_with_y(dask_client, tmp_path):
    """fit(X, y) with X a Dask DataFrame and y a Dask Series; score is R², computed on the
    workers, equal to sklearn's r2_score; no classes_; no predict_proba."""
    import dask.dataframe as dd
    from sklearn.metrics import r2_score

    from shardline.dask import ShardlineEstimator
    from shardline.foundation.errors import ShardlineError

    pdf, config = _small(tmp_path)
    target = pdf["x0"] * 2.0 - pdf["x1"] + 0.5
    X = dd.from_pandas(pdf.drop(columns="label"), npartitions=2)
    y = dd.from_pandas(target.rename("target"), npartitions=2)
    est = ShardlineEstimator(config, {"pipelines.features.task": "regression"}, label_col="target",
                             client=dask_client).fit(X, y)
    assert est.trained_.launcher == "dask" and not hasattr(est, "classes_")
    assert est.prepared_.manifest.feature_spec.task == "regression"
    pred = est.predict(X)
    assert isinstance(pred, dd.Series)
    got = pred.compute()
    assert got.dtype == np.float64 and got.index.equals(pdf.index)
    assert est.score(X, y) == pytest.approx(r2_score(target, got), abs=1e-9)
    w = dd.from_pandas(pd.Series(np.linspace(1, 3, len(pdf))), npartitions=2)
    assert est.score(X, y, sample_weight=w) == pytest.approx(
        r2_score(target, got, sample_weight=w.compute()), abs=1e-9)
    assert est.score(pdf.drop(columns="label"), target) == pytest.approx(r2_score(target, got), abs=1e-6)
    with pytest.raises(ShardlineError, match="predict_proba: the model is a regression"):
        est.predict_proba(X)


@pytest.mark.slow
def test_dask_estimator_grid_searches_lr_in_a_pipeline_on_arrays(dask_client, tmp_path):
    """#53.7 and #53.23: the estimator after a StandardScaler in a Pipeline (the scaler hands
    on numpy arrays), searched over its own `lr` by GridSearchCV, X and y arrays with the
    integer labels 3 and 7: classes_ keeps them (int64), predictions are them, and the
    refit's MLflow run trained with the best lr. Full tier (marker `slow`): five fits (two
    folds of two candidates, then the refit), on one rank on the session's Dask workers."""
    from mlflow import MlflowClient
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from shardline.dask import ShardlineEstimator

    rng = np.random.default_rng(5)
    X = rng.normal(size=(500, 3)) * [10.0, 5.0, 1.0] + 100.0  # scaled by the Pipeline's first step
    y = np.where((X[:, 0] - 100.0) / 10 + (X[:, 1] - 100.0) / 5 > 0, 7, 3)
    config = _config(tmp_path)
    config["pipelines"]["layout"]["world_size"] = 1
    config["training"] |= {"launcher": "dask", "world_size": 1, "epochs": 3, "batch_size": 32}
    pipe = make_pipeline(StandardScaler(), ShardlineEstimator(config, client=dask_client))
    search = GridSearchCV(pipe, {"shardlineestimator__lr": [1e-3, 3e-2]}, cv=2, error_score="raise").fit(X, y)

    best = search.best_estimator_[-1]
    assert best.classes_.dtype == np.int64 and best.classes_.tolist() == [3, 7]
    assert best.n_features_in_ == 3 and not hasattr(best, "feature_names_in_")  # arrays have no names
    pred = search.predict(X)
    assert pred.dtype == np.int64 and set(pred.tolist()) <= {3, 7}
    assert (pred == y).mean() > 0.9, (pred == y).mean()  # a linear boundary; chance is about 0.5
    assert search.predict_proba(X).shape == (len(X), 2)
    lr = search.best_params_["shardlineestimator__lr"]
    run = MlflowClient(config["tracking"]["tracking_uri"]).get_run(best.trained_.run_id)
    assert float(run.data.params["lr"]) == lr


_KINDS = {"x0": "numeric", "color": "categorical", "when": None, "label": "numeric", "id": "numeric"}


@pytest.mark.parametrize("written, args, message", [
    ({"pipelines": {"features": {"label": "y"}}}, {"label_col": "label"},
     r"^label_col = 'label' but pipelines.features.label = 'y': give it once$"),
    ({}, {"label_col": "target"}, r"^label_col: the DataFrame has no column 'target' \(its columns: x0, color"),
    ({}, {"key_col": "row"}, r"^key_col: the DataFrame has no column 'row'"),
    ({"pipelines": {"features": {"numeric": ["x0"]}}}, {"feature_cols": ["x0"]},
     r"^feature_cols and pipelines.features.numeric/categorical both name the features: give them once$"),
    ({}, {"feature_cols": ["when"]}, r"^column 'when': its type is neither numeric nor text"),
    ({}, {"feature_cols": ["x9"]}, r"^feature_cols: the DataFrame has no column 'x9'"),
    ({"pipelines": {"source": {"format": "csv"}}}, {},
     r"^pipelines.source.format = 'csv': an estimator's source is the DataFrame given to fit"),
])
def test_a_fit_refuses_columns_named_twice_or_missing_in_one_line(written, args, message, tmp_path):
    # Checked on the fit's arguments and the config alone, before any engine is asked for.
    from shardline.estimators import plan_fit
    from shardline.foundation.errors import ConfigError

    base = {"label_col": None, "feature_cols": None, "key_col": "id"}
    with pytest.raises(ConfigError, match=message):
        plan_fit(written, (), _KINDS, **{**base, **args}, raw_dir=str(tmp_path / "raw"), engine="local")


def test_a_fit_without_a_key_generates_one_unless_the_frame_has_its_name(tmp_path):
    from shardline.estimators import GENERATED_KEY, plan_fit
    from shardline.foundation.errors import ConfigError

    kinds = {"x0": "numeric", "color": "categorical", "label": "numeric"}
    fit = plan_fit({}, (), kinds, label_col=None, feature_cols=None, key_col=None,
                   raw_dir=str(tmp_path / "raw"), engine="local")
    assert fit.generated_key == GENERATED_KEY and fit.columns == [GENERATED_KEY, "label", "x0", "color"]
    assert fit.cfg.pipelines.features.numeric == ["x0"] and fit.cfg.pipelines.features.categorical == ["color"]
    with pytest.raises(ConfigError, match=f"^the DataFrame has a column '{GENERATED_KEY}' already: name its key"):
        plan_fit({}, (), {**kinds, GENERATED_KEY: "numeric"}, label_col=None, feature_cols=None, key_col=None,
                 raw_dir=str(tmp_path / "raw"), engine="local")
