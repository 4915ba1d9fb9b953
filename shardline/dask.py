"""shardline with scikit-learn's estimator interface, on Dask or pandas DataFrames:

    est = ShardlineEstimator(config="job.toml", label_col="label", client=client).fit(ddf)
    est.predict(ddf)         # a dask Series: the class (one of est.classes_) or the value
    est.predict_proba(ddf)   # classification: a dask DataFrame, one column per class
    est.score(ddf)           # accuracy (classification) or R² (regression), a float

scikit-learn is not needed to use it, but its tools take it: `get_params`/`set_params`
(the parameters are `__init__`'s arguments, the training settings a search tunes among
them: `GridSearchCV(est, {"lr": [1e-3, 3e-3]})`), `sklearn.base.clone`, `fit(X, y=None)`,
`classes_` (the labels as given), `n_features_in_`, `feature_names_in_`, a Pipeline after
a scaler. X is a pandas or Dask DataFrame, or a 2-D array (its columns are x0, x1, ...);
pandas or array input gives numpy results (as scikit-learn's own estimators do), a Dask
DataFrame gives Dask collections.

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

import dataclasses
from typing import Any

import numpy as np

from shardline import api
from shardline.api import load_config
from shardline.foundation.errors import ShardlineError
from shardline.foundation.report import stage
from shardline.pipelines.sources import with_row_key, write_pandas_part
from shardline.serving.frames import feature_columns, predict_partition

from .dask_frames import (
    InputError,
    as_frame,
    check_discrete,
    check_finite,
    dask_frame,
    dask_kinds,
    dask_series,
    encoded,
    is_dask,
    label_classes,
    needs_encoding,
    with_label,
)
from .estimators import Fitted, SklearnParams, label_name, plan_fit
from .hyperparams import TUNED, with_tuned

# Imported inside the functions that use them: pandas (~0.7 s: only where a DataFrame is built); Dask (only
# with a Dask client); scikit-learn (optional: only when the caller uses it).

_FITTED = ("fitted_", "prepared_", "trained_", "classes_", "n_features_in_", "feature_names_in_")

__all__ = ["ShardlineEstimator", "dask_kinds"]


class ShardlineEstimator(SklearnParams):
    """config, overrides: as shardline.api takes them. label_col, feature_cols, key_col: fill
    in pipelines.features where the config leaves them unset; no key column: one is
    generated. raw_dir: where the DataFrame is written (a path or URL every worker reaches).
    client: the Dask client to run on (a clone shares it).
    model, model_args, hidden, strategy, epochs, batch_size, lr, weight_decay, lr_schedule,
    warmup_steps, seed: training.<name> (shardline.hyperparams); None keeps the config's.
    After fit: `fitted_` (model URI, tracking URI, run id), `prepared_` and `trained_`
    (shardline.api's results), `classes_` (classification: the labels as given, sorted),
    `n_features_in_`, and `feature_names_in_` (the columns the model reads, when X had names)."""

    _shared_params = ("client",)

    def __init__(self, config=None, overrides=(), *, label_col: str | None = None,
                 feature_cols: list[str] | None = None, key_col: str | None = None, raw_dir: str | None = None,
                 client=None, model: str | None = None, model_args: dict[str, Any] | None = None,
                 hidden: list[int] | None = None, strategy: str | None = None, epochs: int | None = None,
                 batch_size: int | None = None, lr: float | None = None, weight_decay: float | None = None,
                 lr_schedule: str | None = None, warmup_steps: int | None = None, seed: int | None = None):
        # Stored as given, nothing derived: scikit-learn's clone and set_params rely on it.
        self.config = config
        self.overrides = overrides
        self.label_col = label_col
        self.feature_cols = feature_cols
        self.key_col = key_col
        self.raw_dir = raw_dir
        self.client = client
        self.model = model
        self.model_args = model_args
        self.hidden = hidden
        self.strategy = strategy
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.lr_schedule = lr_schedule
        self.warmup_steps = warmup_steps
        self.seed = seed

    @property
    def model_uri(self) -> str:
        return self._fitted().model_uri

    def fit(self, X, y=None) -> ShardlineEstimator:
        """Train on X (a Dask or pandas DataFrame, or a 2-D array). y (a Series or array; a
        Dask Series partitioned as X when X is Dask): the label, written as the label column
        (label_col, else the config's, else "label"); without y, X holds the label column."""

        for name in _FITTED:  # a refit of another task must not keep the old classes_
            self.__dict__.pop(name, None)
        client = self.client or _default_client()
        named = _has_names(X)
        X = as_frame(X, "fit")
        label_col = self.label_col
        if y is not None:
            label_col = label_name(self.config, self.overrides, self.label_col)
            X = with_label(X, y, label_col)
        df = dask_frame(X, client)
        cfg = with_tuned(api.load_config(self.config, self.overrides),
                         {t.name: getattr(self, t.name) for t in TUNED}, self.overrides)
        plan = plan_fit(cfg, (), dask_kinds(df.dtypes), label_col=label_col, feature_cols=self.feature_cols,
                        key_col=self.key_col, raw_dir=self.raw_dir, engine="dask", client=client)
        features = plan.cfg.pipelines.features
        if not is_dask(X) and features.on_invalid_features == "fail":  # in memory: refused before any write
            check_finite(X, features.numeric or [], "fit")
        classes, plan, df = _classes_of(plan, df)
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
        if named:  # as scikit-learn's: only when X had column names of its own
            self.feature_names_in_ = np.asarray(features, dtype=object)
        self.n_features_in_ = len(features)
        if fitted.classification:
            self.classes_ = classes if classes is not None else _declared_classes(fitted)
        return self

    def predict(self, X):
        """The class (one of classes_) or the value (float64) per row: a dask Series
        `prediction` partitioned as X, or for a pandas X or an array a numpy array."""
        import pandas as pd

        f = self._fitted()
        X = self._frame(X, "predict")
        if is_dask(X):
            meta = pd.Series([], dtype="int64" if f.classification else "float64", name="prediction")
            pred = X.map_partitions(predict_partition, f.model_uri, f.tracking_uri, f.transform_json, False,
                                    meta=meta)
            if f.classification and needs_encoding(self.classes_):
                # The index the model predicts, mapped to its label (pandas' own map, on the workers).
                return pred.map(dict(enumerate(self.classes_.tolist())), meta=("prediction", self.classes_.dtype))
            return pred
        pred = predict_partition(X, f.model_uri, f.tracking_uri, f.transform_json, False).to_numpy()
        return self.classes_[pred] if f.classification and needs_encoding(self.classes_) else pred

    def predict_proba(self, X):
        """Classification: the class probabilities, one column per class in classes_ order: a
        dask DataFrame (columns: the classes) partitioned as X, or for a pandas X or an array
        a numpy array [rows, classes]."""
        import pandas as pd

        f = self._fitted()
        if not f.classification:
            raise ShardlineError("predict_proba: the model is a regression (no class probabilities)")
        X = self._frame(X, "predict_proba")
        if is_dask(X):
            classes = f.transform.stats.num_classes
            meta = pd.DataFrame({k: pd.Series([], dtype="float32") for k in range(classes)})
            probs = X.map_partitions(predict_partition, f.model_uri, f.tracking_uri, f.transform_json, True,
                                     meta=meta)
            names = self.classes_.tolist()
            return probs.rename(columns=dict(enumerate(names))) if needs_encoding(self.classes_) else probs
        return predict_partition(X, f.model_uri, f.tracking_uri, f.transform_json, True).to_numpy()

    def score(self, X, y=None, sample_weight=None) -> float:
        """Accuracy (classification) or R² (regression) of predict(X) against y, as
        scikit-learn's ClassifierMixin and RegressorMixin define them; without y, X's label
        column. A Dask X is scored on the workers (y, sample_weight: Dask Series then)."""
        f = self._fitted()
        if y is None:
            label = f.transform.spec.label
            if label not in getattr(X, "columns", ()):
                raise InputError(f"score: no y given and X has no label column '{label}'")
            y = X[label]
        pred = self.predict(X)
        if is_dask(X):
            from dask.base import compute

            y = dask_series(y, "y")
            w = None if sample_weight is None else dask_series(sample_weight, "sample_weight")
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

        try:
            return load_config(self.config, self.overrides).pipelines.features.task
        except ShardlineError:  # a config that does not load says so at fit, not here
            return None

    def _fitted(self) -> Fitted:
        fitted = getattr(self, "fitted_", None)
        if fitted is None:
            raise _not_fitted_error()("this ShardlineEstimator is not fitted yet: call fit(X) first")
        fitted.check()  # the model version, before any worker loads it
        return fitted

    def _frame(self, X, call: str):
        """X to predict on as a DataFrame: an array's columns are the fitted model's features,
        by position (as it was fitted on an array, or as a Pipeline's scaler hands them on)."""
        transform = self._fitted().transform
        X = as_frame(X, call, columns=feature_columns(transform))
        if not is_dask(X) and transform.spec.on_invalid_features == "fail":
            check_finite(X, transform.spec.numeric or [], call)
        return X


_NOT_FITTED: list[type] = []


def _not_fitted_error() -> type:
    """The error of predict before fit: a ShardlineError that is scikit-learn's
    NotFittedError where scikit-learn is installed (what its tools catch), else what that
    is, a ValueError and an AttributeError. Made at the first use: importing scikit-learn
    costs `import shardline.dask` a second."""
    if not _NOT_FITTED:
        try:
            from sklearn.exceptions import NotFittedError as base
        except ImportError:
            bases: tuple[type, ...] = (ShardlineError, ValueError, AttributeError)
        else:
            bases = (ShardlineError, base)
        _NOT_FITTED.append(type("NotFittedError", bases, {"__module__": __name__}))
    return _NOT_FITTED[0]


def _has_names(X) -> bool:
    """Whether X names its columns (a DataFrame with string column names), as scikit-learn
    decides to set feature_names_in_."""
    columns = getattr(X, "columns", None)
    return columns is not None and all(isinstance(c, str) for c in columns)


def _classes_of(plan, df):
    """(classes_, plan, df) of a fit: a classification whose config declares no classes gets
    its labels' distinct values as classes_ (as given: integers stay integers, names stay
    names), and labels that are not already 0..K-1 are mapped to their positions for
    training, with pipelines.features.classes = K; else (None, plan, df) unchanged."""
    from shardline.api import load_config

    spec = plan.cfg.pipelines.features
    if spec.task != "classification" or spec.classes is not None:
        return None, plan, df
    classes = label_classes(df[spec.label])
    check_discrete(classes, spec.label)
    if len(classes) < 2:
        raise InputError(f"fit: the label column '{spec.label}' holds one class ({classes.tolist()}): a "
                         "classifier needs at least 2 classes")
    plan = dataclasses.replace(plan, cfg=load_config(plan.cfg, {"pipelines.features.classes": len(classes)}))
    return classes, plan, encoded(df, spec.label, classes) if needs_encoding(classes) else df


def _declared_classes(fitted: Fitted) -> np.ndarray:
    """The config's classes: the names in pipelines.features.classes, else 0..K-1."""
    t = fitted.transform
    names = t.spec.class_names
    return np.asarray(names, dtype=object) if names else np.arange(t.stats.num_classes, dtype=np.int64)


def _mean(x, w):
    return x.mean() if w is None else (x * w).sum() / w.sum()


def _sum(x, w):
    return x.sum() if w is None else (x * w).sum()


def _as_computed(*values):
    return values


def _default_client():
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):  # no client: shardline.api starts the config's engines
        return None
