"""shardline with Dask's fit/predict conventions:

    est = ShardlineEstimator(config="job.toml", label_col="label").fit(dask_df)
    est.predict(dask_df)         # a dask Series of predictions (class index or value)
    est.predict_proba(dask_df)   # classification: a dask DataFrame, one column per class

`fit` writes the DataFrame's columns as raw Parquet (`raw_dir`, default a new folder under
pipelines.source.path), then prepares, trains and registers through shardline.api on the
Dask client (`client=`, else the current default client, else engines from the config).
Predictions run per partition on the workers, with the training dataset's statistics and
the model cached once per worker process. The partition functions live in the engine
packages (shardline.pipelines, .serving), which workers elsewhere get with the job's code.
"""

from __future__ import annotations

from shardline.pipelines.sources import with_row_key, write_pandas_part
from shardline.serving.frames import predict_partition

from .estimators import Fitted, plan_fit


class ShardlineEstimator:
    """config, overrides: as shardline.api takes them. label_col, feature_cols, key_col: fill
    in pipelines.features where the config leaves them unset; no key column: one is
    generated. raw_dir: where the DataFrame is written (a path or URL every worker reaches).
    After fit: `fitted_` (model URI, tracking URI, run id), `prepared_` and `trained_`
    (shardline.api's results)."""

    def __init__(self, config=None, overrides=(), *, label_col: str | None = None,
                 feature_cols: list[str] | None = None, key_col: str | None = None, raw_dir: str | None = None,
                 client=None):
        self.config, self.overrides, self.label_col = config, overrides, label_col
        self.feature_cols, self.key_col, self.raw_dir, self.client = feature_cols, key_col, raw_dir, client
        self.fitted_: Fitted | None = None
        self.prepared_ = self.trained_ = None

    @property
    def model_uri(self) -> str:
        return self._fitted().model_uri

    def fit(self, ddf) -> ShardlineEstimator:
        from shardline import api
        from shardline.pipelines.report import stage

        client = self.client or _default_client()
        plan = plan_fit(self.config, self.overrides, dask_kinds(ddf.dtypes), label_col=self.label_col,
                        feature_cols=self.feature_cols, key_col=self.key_col, raw_dir=self.raw_dir,
                        engine="dask", client=client)
        df = ddf
        if plan.generated_key:
            df = df.map_partitions(with_row_key, plan.generated_key, meta=with_row_key(df._meta, plan.generated_key))
        raw = plan.raw_dir
        with stage(f"Writing the DataFrame's {len(plan.columns)} columns to {raw}"):
            df[plan.columns].map_partitions(write_pandas_part, raw, meta=("rows", "int64")).compute()
        self.prepared_ = api.prepare(plan.cfg, client=client)
        self.trained_ = api.train(plan.cfg, client=client)
        self.fitted_ = Fitted.of(self.prepared_, self.trained_)
        return self

    def predict(self, ddf):
        """A dask Series `prediction`, partitioned as `ddf`: the class index (int64) or the value (float64)."""
        import pandas as pd

        f = self._fitted()
        meta = pd.Series([], dtype="int64" if f.classification else "float64", name="prediction")
        return ddf.map_partitions(predict_partition, f.model_uri, f.tracking_uri, f.transform_json, False, meta=meta)

    def predict_proba(self, ddf):
        """Classification: a dask DataFrame of class probabilities, columns 0..K-1."""
        import pandas as pd

        from shardline.pipelines.errors import ShardlineError

        f = self._fitted()
        if not f.classification:
            raise ShardlineError("predict_proba: the model is a regression (no class probabilities)")
        classes = f.transform.stats.num_classes
        meta = pd.DataFrame({k: pd.Series([], dtype="float32") for k in range(classes)})
        return ddf.map_partitions(predict_partition, f.model_uri, f.tracking_uri, f.transform_json, True, meta=meta)

    def _fitted(self) -> Fitted:
        if self.fitted_ is None:
            from shardline.pipelines.errors import ShardlineError

            raise ShardlineError("this ShardlineEstimator is not fitted yet: call fit(dask_df) first")
        return self.fitted_


def dask_kinds(dtypes) -> dict[str, str | None]:
    """column -> numeric / categorical / None, from a (dask) DataFrame's dtypes."""
    from pandas.api.types import is_bool_dtype, is_numeric_dtype, is_object_dtype, is_string_dtype

    def kind(t):
        if is_numeric_dtype(t) and not is_bool_dtype(t):
            return "numeric"
        return "categorical" if is_string_dtype(t) or is_object_dtype(t) or str(t) == "category" else None

    return {str(c): kind(t) for c, t in dtypes.items()}


def _default_client():
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):  # no client: shardline.api starts the config's engines
        return None
