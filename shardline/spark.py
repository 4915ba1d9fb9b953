"""shardline as a Spark ML Estimator/Model pair (Horovod's TorchEstimator is the anchor):

    model = ShardlineEstimator(config="job.toml", label_col="label").fit(spark_df)
    scored = model.transform(spark_df)   # + prediction (+ probability for classification)
    model.save("models/churn")           # the registry URI and settings; ShardlineModel.load(...)

`fit` writes the DataFrame's columns as raw Parquet (`raw_dir`, default a new folder under
pipelines.source.path), then prepares, trains and registers through shardline.api on the
DataFrame's own session, classic or Spark Connect. Both classes are pyspark.ml Params with
defaults and setters, and subclass pyspark.ml's Estimator and Model: plain Python (Params,
`fit` calling `_fit`), so they work on Connect DataFrames as on classic ones and sit in a
pyspark.ml Pipeline. Both are DefaultParamsWritable/Readable: what is saved is their Params
as JSON (pyspark 4.3 writes it with DataFrame calls only, so on Connect too). The fitted
model's weights are not among them: they stay in the MLflow Model Registry (`model_uri`).
"""

# What a user's code calls: type-checked in pyright's basic mode ([tool.pyright] in pyproject.toml).
# pyright: basic
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasLabelCol, HasPredictionCol, HasProbabilityCol
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable, DefaultParamsWriter

from shardline import api
from shardline.api import ShardlineConfig
from shardline.foundation.errors import ShardlineError
from shardline.foundation.redact import MASK, redact
from shardline.foundation.report import stage
from shardline.foundation.spark_setup import adopt_session, is_connect

from .estimators import Fitted, plan_fit
from .hyperparams import with_tuned
from .spark_params import HasTrainingParams

if TYPE_CHECKING:
    from shardline.api import PrepareResult, TrainResult

# Imported inside the functions that use them: pyspark (only with a Spark session: Dask and local jobs never
# import it).


def _config_value(value):
    """A TOML path (str or os.PathLike, kept as a str), a dict of sections or a ShardlineConfig."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (str, dict, ShardlineConfig)):
        return value
    raise TypeError(f"config: a TOML path, a dict of sections or a ShardlineConfig, not {type(value).__name__}")


def _overrides_value(value):
    """--set-style strings (a list) or a {setting: value} mapping (a dict)."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str):
        return [value]
    return TypeConverters.toListString(list(value))


class _Saved(DefaultParamsReadable, DefaultParamsWritable):
    def write(self):
        """The Params as JSON (`save(path)` = `write().save(path)`; `write().overwrite()` too)."""
        assert isinstance(self, Params)  # mixed into Params classes only (and so for type checkers)
        return _Writer(self)


class _Writer(DefaultParamsWriter):
    def saveImpl(self, path: str) -> None:
        for param, value in self.instance.extractParamMap().items():
            try:
                json.dumps(value)
            except TypeError:
                raise ShardlineError(f"save: {param.name} is a {type(value).__name__}, which cannot be saved; "
                                     "give it as a TOML path or a dict to save this stage") from None
        super().saveImpl(path)

    def _handleOverwrite(self, path: str) -> None:
        if is_connect(self.sparkSession):  # pyspark's own way reaches for the JVM; Connect has its helper
            from pyspark.ml.connect.readwrite import RemoteMLWriter

            RemoteMLWriter.handleOverwrite(path, True)
        else:
            super()._handleOverwrite(path)


class ShardlineEstimator(Estimator, HasLabelCol, HasPredictionCol, HasProbabilityCol, HasTrainingParams, _Saved):
    """config, overrides: as shardline.api takes them. label_col, feature_cols, key_col: fill
    in pipelines.features (label, numeric/categorical by column type, key) where the config
    leaves them unset; no key column: one is generated (`shardline_key`). raw_dir: where the
    DataFrame is written (a path or URL every executor reaches). Each is a Param with a
    setter (setConfig, setOverrides, setLabelCol, setFeatureCols, setKeyCol, setRawDir,
    setPredictionCol, setProbabilityCol); labelCol is used only when set. model, model_args,
    hidden, strategy, epochs, batch_size, lr, weight_decay, lr_schedule, warmup_steps, seed:
    training.<name>, the Params a search tunes (model, modelArgs, ..., batchSize, lr, ...:
    shardline.spark_params), unset unless given (the config's value holds)."""

    config = Param(Params._dummy(), "config", "the job's config: a TOML path or a dict of sections "
                   "(a ShardlineConfig object works, but is not saved)", typeConverter=_config_value)
    overrides = Param(Params._dummy(), "overrides", "settings over the config: 'section.field=value' "
                      "strings or a {'section.field': value} mapping", typeConverter=_overrides_value)
    featureCols = Param(Params._dummy(), "featureCols", "feature columns (default: every column but "
                        "the label and key, by type)", typeConverter=TypeConverters.toListString)
    keyCol = Param(Params._dummy(), "keyCol", "the rows' key column (default: the config's, else "
                   "one generated)", typeConverter=TypeConverters.toString)
    rawDir = Param(Params._dummy(), "rawDir", "where fit writes the DataFrame as raw Parquet (default: "
                   "a new folder under pipelines.source.path)", typeConverter=TypeConverters.toString)

    def __init__(self, config=None, overrides=(), *, label_col: str | None = None,
                 feature_cols: list[str] | None = None, key_col: str | None = None, raw_dir: str | None = None,
                 prediction_col: str = "prediction", probability_col: str = "probability",
                 model: str | None = None, model_args: dict | None = None, hidden: list[int] | None = None,
                 strategy: str | None = None, epochs: int | None = None, batch_size: int | None = None,
                 lr: float | None = None, weight_decay: float | None = None, lr_schedule: str | None = None,
                 warmup_steps: int | None = None, seed: int | None = None):
        super().__init__()
        self._setDefault(config=None, overrides=[], featureCols=None, keyCol=None, rawDir=None,
                         predictionCol="prediction", probabilityCol="probability")
        given = {"config": config, "overrides": overrides if overrides else None, "labelCol": label_col,
                 "featureCols": feature_cols, "keyCol": key_col, "rawDir": raw_dir,
                 "predictionCol": prediction_col if prediction_col != "prediction" else None,
                 "probabilityCol": probability_col if probability_col != "probability" else None}
        self._set(**{k: v for k, v in given.items() if v is not None})  # what is left out keeps its default
        self._set_tuned(dict(model=model, model_args=model_args, hidden=hidden, strategy=strategy, epochs=epochs,
                             batch_size=batch_size, lr=lr, weight_decay=weight_decay, lr_schedule=lr_schedule,
                             warmup_steps=warmup_steps, seed=seed))

    def setConfig(self, value) -> ShardlineEstimator:
        return self._set(config=value)

    def getConfig(self):
        return self.getOrDefault(self.config)

    def setOverrides(self, value) -> ShardlineEstimator:
        return self._set(overrides=value)

    def getOverrides(self):
        return self.getOrDefault(self.overrides)

    def setLabelCol(self, value: str) -> ShardlineEstimator:
        return self._set(labelCol=value)

    def setFeatureCols(self, value: list[str]) -> ShardlineEstimator:
        return self._set(featureCols=value)

    def getFeatureCols(self) -> list[str] | None:
        return self.getOrDefault(self.featureCols)

    def setKeyCol(self, value: str) -> ShardlineEstimator:
        return self._set(keyCol=value)

    def getKeyCol(self) -> str | None:
        return self.getOrDefault(self.keyCol)

    def setRawDir(self, value: str) -> ShardlineEstimator:
        return self._set(rawDir=value)

    def getRawDir(self) -> str | None:
        return self.getOrDefault(self.rawDir)

    def setPredictionCol(self, value: str) -> ShardlineEstimator:
        return self._set(predictionCol=value)

    def setProbabilityCol(self, value: str) -> ShardlineEstimator:
        return self._set(probabilityCol=value)

    def _fit(self, dataset) -> ShardlineModel:
        from pyspark.sql import functions as F

        spark = dataset.sparkSession
        adopt_session(spark)  # the write below runs our code on the executors already
        # labelCol's default ("label") gives way to the config's label: only a set one is the caller's.
        label = self.getLabelCol() if self.isSet(self.labelCol) else None
        cfg = with_tuned(api.load_config(self.getConfig(), self.getOverrides()), self.tuned_values(),
                         self.getOverrides(), spark=True)
        plan = plan_fit(cfg, (), spark_kinds(dataset.schema), label_col=label,
                        feature_cols=self.getFeatureCols(), key_col=self.getKeyCol(), raw_dir=self.getRawDir(),
                        engine="spark", spark=spark)
        df = dataset
        if plan.generated_key:
            df = df.withColumn(plan.generated_key, F.monotonically_increasing_id())
        with stage(f"Writing the DataFrame's {len(plan.columns)} columns to {plan.raw_dir}"):
            _write(spark, df.select(*plan.columns), plan.raw_dir)
        prepared = api.prepare(plan.cfg, spark=spark)
        trained = api.train(plan.cfg, spark=spark)
        model = ShardlineModel(Fitted.of(prepared, trained))
        model._set(labelCol=plan.cfg.pipelines.features.label, predictionCol=self.getPredictionCol(),
                   probabilityCol=self.getProbabilityCol())
        model.prepared, model.trained = prepared, trained
        return model


class ShardlineModel(Model, HasLabelCol, HasPredictionCol, HasProbabilityCol, _Saved):
    """A registered model; `transform(df)` adds `prediction` (class index or value) and, for
    classification, `probability` (array<float>), computed on the executors (mapInArrow) with
    the training dataset's statistics and the model cached once per Python worker.

    Its Params are all it holds: the registry URI (modelUri, pinned to a version), the MLflow
    store (trackingUri; saved with any password or token in it masked: set it again with
    setTrackingUri after load), the run, the training data's feature spec and statistics
    (the transform of raw columns), the task and the output columns. `save(path)` writes
    them; `ShardlineModel.load(path)` reads them back."""

    modelUri = Param(Params._dummy(), "modelUri", "the registered model, models:/NAME/VERSION",
                     typeConverter=TypeConverters.toString)
    trackingUri = Param(Params._dummy(), "trackingUri", "the MLflow store holding it",
                        typeConverter=TypeConverters.toString)
    runId = Param(Params._dummy(), "runId", "the MLflow run that trained it", typeConverter=TypeConverters.toString)
    featureSpec = Param(Params._dummy(), "featureSpec", "the training dataset's feature spec (JSON)",
                        typeConverter=TypeConverters.toString)
    statistics = Param(Params._dummy(), "statistics", "the training dataset's fitted statistics (JSON)",
                       typeConverter=TypeConverters.toString)
    featuresWidth = Param(Params._dummy(), "featuresWidth", "width of the features tensor",
                          typeConverter=TypeConverters.toInt)
    classification = Param(Params._dummy(), "classification", "a classification model (else regression)",
                           typeConverter=TypeConverters.toBoolean)

    def __init__(self, fitted: Fitted | None = None):
        super().__init__()
        self._setDefault(predictionCol="prediction", probabilityCol="probability")
        if fitted is not None:
            spec, stats, width = fitted.transform_json
            self._set(modelUri=fitted.model_uri, trackingUri=fitted.tracking_uri, runId=fitted.run_id,
                      featureSpec=spec, statistics=stats, featuresWidth=width,
                      classification=fitted.classification)
        # shardline.api's results of the fit that made this model (None after load).
        self.prepared: PrepareResult | None = None
        self.trained: TrainResult | None = None

    @property
    def fitted(self) -> Fitted:
        if not self.isSet(self.modelUri):
            raise ShardlineError("this ShardlineModel holds no model: get one from ShardlineEstimator.fit or "
                                 "ShardlineModel.load")
        return Fitted(self.getModelUri(), self.getTrackingUri(), self.getOrDefault(self.runId),
                      (self.getOrDefault(self.featureSpec), self.getOrDefault(self.statistics),
                       self.getOrDefault(self.featuresWidth)), self.getOrDefault(self.classification))

    @property
    def model_uri(self) -> str:
        return self.fitted.model_uri

    def getModelUri(self) -> str:
        return self.getOrDefault(self.modelUri)

    def getTrackingUri(self) -> str:
        return self.getOrDefault(self.trackingUri)

    def setTrackingUri(self, value: str) -> ShardlineModel:
        return self._set(trackingUri=value)

    def setPredictionCol(self, value: str) -> ShardlineModel:
        return self._set(predictionCol=value)

    def setProbabilityCol(self, value: str) -> ShardlineModel:
        return self._set(probabilityCol=value)

    def write(self):
        """As _Saved's, with the tracking URI's secrets masked in what is written."""
        writer = _Writer(self)
        if self.isSet(self.trackingUri) and redact(self.getTrackingUri()) != self.getTrackingUri():
            masked = self.copy()
            masked._set(trackingUri=redact(self.getTrackingUri()))
            writer = _Writer(masked)
        return writer

    def _transform(self, dataset):
        from pyspark.sql.types import ArrayType, DoubleType, FloatType, LongType, StructField, StructType

        fitted = self.fitted
        if MASK in fitted.tracking_uri:
            raise ShardlineError(f"the saved tracking URI {fitted.tracking_uri} had its secret masked: set it "
                                 "with setTrackingUri before transform")
        fitted.check()  # the model version, before any task loads it
        adopt_session(dataset.sparkSession)  # executors that need our code get it
        # Plain values only in the closure: executors have shardline's engine packages, not this module.
        uri, tracking, tjson = fitted.model_uri, fitted.tracking_uri, fitted.transform_json
        classification, pred_col, prob_col = fitted.classification, self.getPredictionCol(), \
            self.getProbabilityCol()
        fields = list(dataset.schema.fields)
        if classification:
            fields += [StructField(pred_col, LongType()), StructField(prob_col, ArrayType(FloatType()))]
        else:
            fields.append(StructField(pred_col, DoubleType()))

        def predict(batches):
            import pyarrow as pa

            from shardline.foundation.environ import leave_removed_cwd

            leave_removed_cwd()  # before the model's torch is imported (foundation.environ)

            from shardline.serving.frames import predict_table, probabilities_array
            from shardline.serving.inputs import Transform

            transform = Transform(*tjson)
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                pred, probs = predict_table(pa.Table.from_batches([batch]), uri, tracking, transform)
                arrays = [*batch.columns, pa.array(pred)]
                names = [*batch.schema.names, pred_col]
                if probs is not None:
                    arrays.append(probabilities_array(probs))
                    names.append(prob_col)
                yield pa.RecordBatch.from_arrays(arrays, names=names)

        return dataset.mapInArrow(predict, StructType(fields))


def spark_kinds(schema) -> dict[str, str | None]:
    """column -> numeric / categorical / None, from a Spark schema."""
    from pyspark.sql.types import BooleanType, NumericType, StringType

    def kind(t):
        if isinstance(t, NumericType) and not isinstance(t, BooleanType):
            return "numeric"
        return "categorical" if isinstance(t, StringType) else None

    return {f.name: kind(f.dataType) for f in schema.fields}


def _write(spark, df, raw_dir: str) -> int:
    """Each partition writes its own Parquet file through foundation.storage (DataFrame
    operations only: Connect has no RDD); rows written."""

    def write(batches):
        import pyarrow as pa
        from pyspark import TaskContext

        from shardline.pipelines.sources import write_raw_part

        ctx = TaskContext.get()
        assert ctx is not None  # inside a task
        rows = write_raw_part(batches, raw_dir, ctx.partitionId())
        yield pa.RecordBatch.from_pydict({"rows": [rows]})

    return sum(r["rows"] for r in df.mapInArrow(write, "rows long").collect())
