"""shardline as a Spark ML Estimator/Transformer pair (Horovod's TorchEstimator is the anchor):

    model = ShardlineEstimator(config="job.toml", label_col="label").fit(spark_df)
    scored = model.transform(spark_df)   # + prediction (+ probability for classification)

`fit` writes the DataFrame's columns as raw Parquet (`raw_dir`, default a new folder under
pipelines.source.path), then prepares, trains and registers through shardline.api on the
DataFrame's own session, classic or Spark Connect. Both classes subclass pyspark.ml's
Estimator and Model: those are plain Python (Params, `fit` calling `_fit`), so they work on
Connect DataFrames as on classic ones, and sit in a pyspark.ml Pipeline. Not MLWritable:
the model lives in the MLflow registry (`model_uri`); `ShardlineModel.load(model_uri, ...)`
is not offered, build one with `ShardlineModel(model_uri=..., ...)` from a fit's fields.
"""

from __future__ import annotations

from pyspark.ml import Estimator, Model
from pyspark.ml.param.shared import HasLabelCol, HasPredictionCol, HasProbabilityCol

from .estimators import Fitted, plan_fit


class ShardlineEstimator(Estimator, HasLabelCol, HasPredictionCol, HasProbabilityCol):
    """config, overrides: as shardline.api takes them. label_col, feature_cols, key_col: fill
    in pipelines.features (label, numeric/categorical by column type, key) where the config
    leaves them unset; no key column: one is generated (`shardline_key`). raw_dir: where the
    DataFrame is written (a path or URL every executor reaches)."""

    def __init__(self, config=None, overrides=(), *, label_col: str | None = None,
                 feature_cols: list[str] | None = None, key_col: str | None = None, raw_dir: str | None = None,
                 prediction_col: str = "prediction", probability_col: str = "probability"):
        super().__init__()
        self.config, self.overrides = config, overrides
        self.feature_cols, self.key_col, self.raw_dir = feature_cols, key_col, raw_dir
        self._label_given = label_col
        self._set(predictionCol=prediction_col, probabilityCol=probability_col)
        if label_col is not None:
            self._set(labelCol=label_col)

    def _fit(self, dataset) -> ShardlineModel:
        from pyspark.sql import functions as F

        from shardline import api
        from shardline.pipelines.report import stage

        from shardline.pipelines.spark_setup import adopt_session

        spark = dataset.sparkSession
        adopt_session(spark)  # the write below runs our code on the executors already
        plan = plan_fit(self.config, self.overrides, spark_kinds(dataset.schema), label_col=self._label_given,
                        feature_cols=self.feature_cols, key_col=self.key_col, raw_dir=self.raw_dir,
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


class ShardlineModel(Model, HasLabelCol, HasPredictionCol, HasProbabilityCol):
    """A registered model; `transform(df)` adds `prediction` (class index or value) and, for
    classification, `probability` (array<float>), computed on the executors (mapInArrow) with
    the training dataset's statistics and the model cached once per Python worker."""

    def __init__(self, fitted: Fitted | None = None):
        super().__init__()
        self.fitted = fitted
        self.prepared = self.trained = None  # shardline.api's PrepareResult and TrainResult of the fit

    @property
    def model_uri(self) -> str:
        return self.fitted.model_uri

    def _transform(self, dataset):
        from pyspark.sql.types import ArrayType, DoubleType, FloatType, LongType, StructField, StructType

        from shardline.pipelines.spark_setup import adopt_session

        adopt_session(dataset.sparkSession)  # executors that need our code get it
        # Plain values only in the closure: executors have shardline's engine packages, not this module.
        uri, tracking, tjson = self.fitted.model_uri, self.fitted.tracking_uri, self.fitted.transform_json
        classification, pred_col, prob_col = self.fitted.classification, self.getPredictionCol(), \
            self.getProbabilityCol()
        fields = list(dataset.schema.fields)
        if classification:
            fields += [StructField(pred_col, LongType()), StructField(prob_col, ArrayType(FloatType()))]
        else:
            fields.append(StructField(pred_col, DoubleType()))

        def predict(batches):
            import pyarrow as pa

            from shardline.pipelines.environ import leave_removed_cwd

            leave_removed_cwd()  # before the model's torch is imported (pipelines.environ)

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
    """Each partition writes its own Parquet file through pipelines.storage (DataFrame
    operations only: Connect has no RDD); rows written."""

    def write(batches):
        import pyarrow as pa
        from pyspark import TaskContext

        from shardline.pipelines.sources import write_raw_part

        rows = write_raw_part(batches, raw_dir, TaskContext.get().partitionId())
        yield pa.RecordBatch.from_pydict({"rows": [rows]})

    return sum(r["rows"] for r in df.mapInArrow(write, "rows long").collect())
