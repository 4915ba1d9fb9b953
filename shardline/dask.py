"""shardline with scikit-learn's estimator interface, on Dask or pandas DataFrames:

    est = ShardlineEstimator(config="job.toml", label_col="label", client=client).fit(ddf)
    est.predict(ddf)         # a dask Series: the class (one of est.classes_) or the value
    est.predict_proba(ddf)   # classification: a dask DataFrame, one column per class
    est.score(ddf)           # accuracy (classification) or R² (regression), a float

scikit-learn is not needed to use it, but its tools take it: `get_params`/`set_params`
(the parameters are `__init__`'s arguments), `sklearn.base.clone`, `fit(X, y=None)`,
`classes_`, `n_features_in_`, `feature_names_in_`. A pandas DataFrame gives numpy results
(as scikit-learn's own estimators do), a Dask DataFrame gives Dask collections.

`fit` writes the DataFrame's columns as raw Parquet (`raw_dir`, default a new folder under
pipelines.source.path), then prepares, trains and registers through shardline.api on the
Dask client (`client=`, else the current default client, else engines from the config).
Predictions of a Dask DataFrame run per partition on the workers, with the training
dataset's statistics and the model cached once per worker process; of a pandas DataFrame,
in this process. The partition functions live in the engine packages (shardline.pipelines,
.serving), which workers elsewhere get with the job's code.
"""

# What a user's code calls: type-checked in pyright's basic mode ([tool.pyright] in pyproject.toml).
# pyright: basic
from __future__ import annotations

import numpy as np

from shardline.foundation.errors import ConfigError, ShardlineError
from shardline.pipelines.sources import with_row_key, write_pandas_part
from shardline.serving.frames import feature_columns, predict_partition

from .estimators import Fitted, SklearnParams, label_name, plan_fit

_FITTED = ("fitted_", "prepared_", "trained_", "classes_", "n_features_in_", "feature_names_in_")


class ShardlineEstimator(SklearnParams):
    """config, overrides: as shardline.api takes them. label_col, feature_cols, key_col: fill
    in pipelines.features where the config leaves them unset; no key column: one is
    generated. raw_dir: where the DataFrame is written (a path or URL every worker reaches).
    client: the Dask client to run on (a clone shares it).
    After fit: `fitted_` (model URI, tracking URI, run id), `prepared_` and `trained_`
    (shardline.api's results), `classes_` (classification), `n_features_in_` and
    `feature_names_in_` (the columns the model reads)."""

    _shared_params = ("client",)

    def __init__(self, config=None, overrides=(), *, label_col: str | None = None,
                 feature_cols: list[str] | None = None, key_col: str | None = None, raw_dir: str | None = None,
                 client=None):
        # Stored as given, nothing derived: scikit-learn's clone and set_params rely on it.
        self.config = config
        self.overrides = overrides
        self.label_col = label_col
        self.feature_cols = feature_cols
        self.key_col = key_col
        self.raw_dir = raw_dir
        self.client = client

    @property
    def model_uri(self) -> str:
        return self._fitted().model_uri

    def fit(self, X, y=None) -> ShardlineEstimator:
        """Train on X (a Dask or pandas DataFrame). y (a Series or array; a Dask Series
        partitioned as X when X is Dask): the label, written as the label column (label_col,
        else the config's, else "label"); without y, X holds the label column."""
        from shardline import api
        from shardline.foundation.report import stage

        for name in _FITTED:  # a refit of another task must not keep the old classes_
            self.__dict__.pop(name, None)
        client = self.client or _default_client()
        label_col = self.label_col
        if y is not None:
            label_col = label_name(self.config, self.overrides, self.label_col)
            X = _with_label(X, y, label_col)
        df = _dask_frame(X, client)
        plan = plan_fit(self.config, self.overrides, dask_kinds(df.dtypes), label_col=label_col,
                        feature_cols=self.feature_cols, key_col=self.key_col, raw_dir=self.raw_dir,
                        engine="dask", client=client)
        if plan.generated_key:
            df = df.map_partitions(with_row_key, plan.generated_key, meta=with_row_key(df._meta, plan.generated_key))
        raw = plan.raw_dir
        with stage(f"Writing the DataFrame's {len(plan.columns)} columns to {raw}"):
            df[plan.columns].map_partitions(write_pandas_part, raw, meta=("rows", "int64")).compute()
        prepared = api.prepare(plan.cfg, client=client)
        trained = api.train(plan.cfg, client=client)
        fitted = Fitted.of(prepared, trained)
        self.prepared_, self.trained_, self.fitted_ = prepared, trained, fitted
        features = feature_columns(fitted.transform)
        self.feature_names_in_ = np.asarray(features, dtype=object)
        self.n_features_in_ = len(features)
        if fitted.classification:
            self.classes_ = _classes(fitted)
        return self

    def predict(self, X):
        """The class (one of classes_) or the value (float64) per row: a dask Series
        `prediction` partitioned as X, or for a pandas X a numpy array."""
        import pandas as pd

        f = self._fitted()
        names = f.transform.spec.class_names if f.classification else None
        if _is_dask(X):
            meta = pd.Series([], dtype="int64" if f.classification else "float64", name="prediction")
            pred = X.map_partitions(predict_partition, f.model_uri, f.tracking_uri, f.transform_json, False,
                                    meta=meta)
            # Named classes: the index the model predicts, mapped to its name (pandas' own map).
            return pred.map(dict(enumerate(names)), meta=("prediction", "object")) if names else pred
        pred = predict_partition(_pandas_frame(X, "predict"), f.model_uri, f.tracking_uri, f.transform_json,
                                 False).to_numpy()
        return self.classes_[pred] if names else pred

    def predict_proba(self, X):
        """Classification: the class probabilities, one column per class in classes_ order: a
        dask DataFrame (columns: the classes) partitioned as X, or for a pandas X a numpy
        array [rows, classes]."""
        import pandas as pd

        f = self._fitted()
        if not f.classification:
            raise ShardlineError("predict_proba: the model is a regression (no class probabilities)")
        classes = f.transform.stats.num_classes
        if _is_dask(X):
            meta = pd.DataFrame({k: pd.Series([], dtype="float32") for k in range(classes)})
            probs = X.map_partitions(predict_partition, f.model_uri, f.tracking_uri, f.transform_json, True,
                                     meta=meta)
            names = f.transform.spec.class_names
            return probs.rename(columns=dict(enumerate(names))) if names else probs
        return predict_partition(_pandas_frame(X, "predict_proba"), f.model_uri, f.tracking_uri,
                                 f.transform_json, True).to_numpy()

    def score(self, X, y=None, sample_weight=None) -> float:
        """Accuracy (classification) or R² (regression) of predict(X) against y, as
        scikit-learn's ClassifierMixin and RegressorMixin define them; without y, X's label
        column. A Dask X is scored on the workers (y, sample_weight: Dask Series then)."""
        f = self._fitted()
        if y is None:
            label = f.transform.spec.label
            if label not in X.columns:
                raise ShardlineError(f"score: no y given and X has no label column '{label}'")
            y = X[label]
        pred = self.predict(X)
        if _is_dask(X):
            from dask.base import compute

            y = _dask_series(y, "y")
            w = None if sample_weight is None else _dask_series(sample_weight, "sample_weight")
        else:
            compute = _as_computed
            y = np.asarray(y)
            w = None if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if f.classification:
            return float(compute(_mean(pred == y, w))[0])
        mean = float(compute(_mean(y, w))[0])  # first, as r2_score does: no cancellation in the sums
        ss_res, ss_tot = compute(_sum((y - pred) ** 2, w), _sum((y - mean) ** 2, w))
        if ss_tot == 0:  # sklearn's r2_score(force_finite=True): a constant y
            return 1.0 if ss_res == 0 else 0.0
        return float(1 - ss_res / ss_tot)

    def __sklearn_tags__(self):
        """For scikit-learn's tools (is_classifier, cross-validation's splitter): the kind is
        the fitted model's task, else the config's pipelines.features.task."""
        from sklearn.utils import ClassifierTags, InputTags, RegressorTags, Tags, TargetTags

        kind = {"classification": "classifier", "regression": "regressor"}.get(self._task() or "")
        return Tags(
            estimator_type=kind,
            target_tags=TargetTags(required=False),  # the label may be a column of X
            classifier_tags=ClassifierTags() if kind == "classifier" else None,
            regressor_tags=RegressorTags() if kind == "regressor" else None,
            input_tags=InputTags(two_d_array=True, categorical=True, string=True),
            non_deterministic=True,  # training on several ranks
        )

    def _task(self) -> str | None:
        fitted = getattr(self, "fitted_", None)
        if fitted is not None:
            return "classification" if fitted.classification else "regression"
        from shardline.api import load_config

        try:
            return load_config(self.config, self.overrides).pipelines.features.task
        except ShardlineError:  # a config that does not load says so at fit, not here
            return None

    def _fitted(self) -> Fitted:
        fitted = getattr(self, "fitted_", None)
        if fitted is None:
            raise ShardlineError("this ShardlineEstimator is not fitted yet: call fit(X) first")
        return fitted


def _classes(fitted: Fitted) -> np.ndarray:
    """The labels predict returns: the names in pipelines.features.classes, else 0..K-1."""
    t = fitted.transform
    names = t.spec.class_names
    return np.asarray(names, dtype=object) if names else np.arange(t.stats.num_classes, dtype=np.int64)


def _mean(x, w):
    return x.mean() if w is None else (x * w).sum() / w.sum()


def _sum(x, w):
    return x.sum() if w is None else (x * w).sum()


def _as_computed(*values):
    return values


def _is_dask(obj) -> bool:
    return type(obj).__module__.split(".")[0] in ("dask", "dask_expr")


def _pandas_frame(X, call: str):
    import pandas as pd

    if not isinstance(X, pd.DataFrame):
        raise ShardlineError(f"{call}: X is a {type(X).__name__}; give a pandas or Dask DataFrame "
                             "(shardline reads its columns by name)")
    return X


def _dask_frame(X, client):
    """X as a Dask DataFrame: a pandas one is split in as many partitions as the client has
    workers, each written by one of them."""
    if _is_dask(X):
        return X
    import dask.dataframe as dd

    X = _pandas_frame(X, "fit")
    workers = len(client.scheduler_info().get("workers", {})) if client is not None else 1
    return dd.from_pandas(X, npartitions=max(1, min(workers, len(X))))


def _dask_series(y, what: str):
    if not _is_dask(y):
        raise ShardlineError(f"score: X is a Dask DataFrame, so {what} must be a Dask Series partitioned as X")
    return y


def _with_label(X, y, name: str):
    """X with y as its column `name`: by position for a pandas X, by index for a Dask one."""
    if name in X.columns:
        raise ConfigError(f"fit: y is given and X has a column '{name}' too: leave y out (label_col names "
                          "X's label column) or drop the column from X")
    if _is_dask(X):
        import dask.dataframe as dd

        if not isinstance(y, dd.Series):
            raise ConfigError("fit: X is a Dask DataFrame, so y must be a Dask Series partitioned as X "
                              "(or leave y out and name X's label column with label_col)")
        try:
            return X.assign(**{name: y})
        except ValueError as e:
            raise ConfigError(f"fit: y does not line up with X's partitions: {e}") from None
    values = np.asarray(y.compute() if _is_dask(y) else y)
    if values.ndim != 1 or len(values) != len(_pandas_frame(X, "fit")):
        raise ConfigError(f"fit: y has shape {values.shape}, X has {len(X)} rows: give one label per row")
    return X.assign(**{name: values})


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
