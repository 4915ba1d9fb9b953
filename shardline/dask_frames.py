"""What the Dask estimator (shardline.dask) takes as X and y, made into the DataFrame it
writes: pandas and Dask DataFrames as they are, numpy arrays (what a scikit-learn
Pipeline's scaler hands on) as columns x0, x1, ...; labels as given, encoded to 0..K-1
for training where they are not already (classes_ keeps them as given)."""

from __future__ import annotations

import numpy as np

from shardline.foundation.errors import ConfigError, ShardlineError


class InputError(ShardlineError, ValueError):
    """X or y that the estimator cannot take: a ValueError too, as scikit-learn's tools
    (and its estimators' callers) expect of an estimator refusing its input."""


def is_dask(obj) -> bool:
    return type(obj).__module__.split(".")[0] in ("dask", "dask_expr")


def array_columns(n: int) -> list[str]:
    """The names an array's columns get: x0, x1, ... (an array has none of its own)."""
    return [f"x{i}" for i in range(n)]


def as_frame(X, call: str, columns: list[str] | None = None):
    """X as a pandas or Dask DataFrame. An array (2-D; numpy, or anything np.asarray takes),
    or a DataFrame whose column names are not all strings (scikit-learn's "no feature
    names"), gets `columns` (predict: the fitted model's, by position), else x0, x1, ...;
    it must have as many columns as those."""
    import pandas as pd

    if isinstance(X, pd.Series) or (is_dask(X) and getattr(X, "ndim", 2) == 1):
        raise InputError(f"{call}: X is a Series; give a 2-D array or a DataFrame (one column per feature)")
    if is_dask(X) or (isinstance(X, pd.DataFrame) and all(isinstance(c, str) for c in X.columns)):
        return X
    if type(X).__module__.startswith("scipy.sparse"):
        raise InputError(f"{call}: X is a sparse {type(X).__name__}: sparse input is not supported; give a dense "
                         "array or a DataFrame")
    try:
        a = X.to_numpy() if isinstance(X, pd.DataFrame) else np.asarray(X)
    except Exception as e:  # noqa: BLE001 (anything numpy cannot make an array of)
        raise InputError(f"{call}: X is a {type(X).__name__}, which is no array or DataFrame ({e})") from None
    if a.dtype.kind == "c":
        raise InputError(f"{call}: X holds complex numbers: Complex data not supported")
    if a.ndim != 2:
        raise InputError(f"{call}: X has {a.ndim} dimension(s); Expected a 2D array (rows x features); "
                         "Reshape your data with X.reshape(-1, 1) for one feature or X.reshape(1, -1) for one row")
    for n, what in ((a.shape[0], "sample"), (a.shape[1], "feature")):
        if n == 0:  # scikit-learn's words
            raise InputError(f"{call}: Found array with 0 {what}(s) (shape={a.shape}) while a minimum of 1 is "
                             "required.")
    names = columns if columns is not None else array_columns(a.shape[1])
    if a.shape[1] != len(names):
        raise InputError(f"{call}: X has {a.shape[1]} features, but ShardlineEstimator is expecting "
                         f"{len(names)} features as input")
    if isinstance(X, pd.DataFrame):
        return X.set_axis(names, axis=1)  # its rows and dtypes, named by position
    return pd.DataFrame(a, columns=names)


def check_finite(frame, columns: list[str], call: str) -> None:
    """A pandas frame's numeric columns among `columns` hold no NaN or inf (what prepare and
    scoring refuse with pipelines.features.on_invalid_features = 'fail'), checked before
    anything is written."""
    from pandas.api.types import is_numeric_dtype

    for c in columns:
        if c in frame.columns and is_numeric_dtype(frame[c].dtype) \
                and not np.isfinite(frame[c].to_numpy(dtype=np.float64, na_value=np.nan)).all():
            raise InputError(f"{call}: column '{c}' holds NaN or inf (pipelines.features.on_invalid_features = "
                             "'fail'; 'impute' takes them)")


def dask_frame(X, client):
    """X as a Dask DataFrame: a pandas one is split in as many partitions as the client has
    workers, each written by one of them."""
    if is_dask(X):
        return X
    import dask.dataframe as dd

    workers = len(client.scheduler_info().get("workers", {})) if client is not None else 1
    return dd.from_pandas(X, npartitions=max(1, min(workers, len(X))))


def dask_series(y, what: str):
    if not is_dask(y):
        raise InputError(f"score: X is a Dask DataFrame, so {what} must be a Dask Series partitioned as X")
    return y


def with_label(X, y, name: str):
    """X with y as its column `name`: by position for a pandas X, by index for a Dask one."""
    if name in X.columns:
        raise ConfigError(f"fit: y is given and X has a column '{name}' too: leave y out (label_col names "
                          "X's label column) or drop the column from X")
    if is_dask(X):
        import dask.dataframe as dd

        if not isinstance(y, dd.Series):
            raise ConfigError("fit: X is a Dask DataFrame, so y must be a Dask Series partitioned as X "
                              "(or leave y out and name X's label column with label_col)")
        try:
            return X.assign(**{name: y})
        except ValueError as e:
            raise ConfigError(f"fit: y does not line up with X's partitions: {e}") from None
    values = np.asarray(y.compute() if is_dask(y) else y)
    if values.ndim == 2 and values.shape[1] == 1:
        _warn_column_vector()
        values = values[:, 0]  # a column vector: one label per row all the same
    if values.ndim != 1 or len(values) != len(X):
        raise InputError(f"fit: y has shape {values.shape}, X has {len(X)} rows: give one label per row")
    return X.assign(**{name: values})


def label_classes(labels) -> np.ndarray:
    """The distinct labels (a pandas or Dask Series), sorted, as given (np.unique's order and
    dtype, as scikit-learn's classifiers keep them in classes_)."""
    import pandas as pd

    # split_out=1: a tree reduction on the workers (unique() shuffles, and says so in warnings).
    values = pd.Series(labels.drop_duplicates(split_out=1).compute() if is_dask(labels) else labels.unique())
    if values.isna().any():
        raise InputError(f"fit: the label column '{labels.name}' has missing values (NaN or None)")
    try:
        return np.unique(values.to_numpy())
    except TypeError as e:  # labels of several types ("a" and 1) have no order
        raise InputError(f"fit: the labels cannot be sorted ({e}): give labels of one type") from None


def _warn_column_vector() -> None:
    """scikit-learn's warning for y of shape (n, 1): its DataConversionWarning where
    scikit-learn is installed (its tools filter on it), else a UserWarning."""
    import warnings

    try:
        from sklearn.exceptions import DataConversionWarning as category
    except ImportError:
        category = UserWarning
    warnings.warn("A column-vector y was passed when a 1d array was expected. Please change the shape of y to "
                  "(n_samples, ), for example using ravel().", category, stacklevel=4)


def check_discrete(classes: np.ndarray, label: str) -> None:
    """Classification labels are classes, not measurements: float labels with a fractional
    part are refused (scikit-learn's "Unknown label type: continuous")."""
    if classes.dtype.kind == "f" and not np.array_equal(classes, np.round(classes)):
        raise InputError(f"fit: Unknown label type: continuous: the label '{label}' has values like "
                         f"{classes[classes != np.round(classes)][0]!r}; a regression needs "
                         "pipelines.features.task = 'regression'")


def needs_encoding(classes: np.ndarray) -> bool:
    """Whether labels must be mapped to 0..K-1 for training: unless they are those integers."""
    return not (classes.dtype.kind in "iu" and np.array_equal(classes, np.arange(len(classes))))


def encoded(df, label: str, classes: np.ndarray):
    """df with its label column mapped to the class positions 0..K-1 (pandas' own map, on
    the workers for a Dask df: no shardline code runs there)."""
    to_index = {c.item() if hasattr(c, "item") else c: i for i, c in enumerate(classes)}
    return df.assign(**{label: df[label].map(to_index, meta=(label, "int64")) if is_dask(df)
                        else df[label].map(to_index).astype("int64")})


def dask_kinds(dtypes) -> dict[str, str | None]:
    """column -> numeric / categorical / None, from a (dask) DataFrame's dtypes."""
    from pandas.api.types import is_bool_dtype, is_numeric_dtype, is_object_dtype, is_string_dtype

    def kind(t):
        if is_numeric_dtype(t) and not is_bool_dtype(t):
            return "numeric"
        return "categorical" if is_string_dtype(t) or is_object_dtype(t) or str(t) == "category" else None

    return {str(c): kind(t) for c, t in dtypes.items()}
