"""What the Spark and Dask estimators share: the config of a fit (its DataFrame is the source,
written as raw Parquet first) and the fitted model's description."""

# What a user's code calls: type-checked in pyright's basic mode ([tool.pyright] in pyproject.toml).
# pyright: basic
from __future__ import annotations

import copy
import datetime as dt
import inspect
import uuid
from dataclasses import dataclass

from shardline.api import load_config
from shardline.foundation.errors import ConfigError
from shardline.foundation.storage import join, resolve
from shardline.serving.config import ServingConfig
from shardline.serving.inputs import Transform
from shardline.serving.job import ScoringJob

from .config import ShardlineConfig, cluster_of

GENERATED_KEY = "shardline_key"


@dataclass(frozen=True)
class FitPlan:
    cfg: ShardlineConfig  # with pipelines.source and pipelines.features set for this DataFrame
    raw_dir: str  # where the DataFrame is written (resolved: absolute path or URL)
    columns: list[str]  # the DataFrame's columns to write (a generated key among them)
    generated_key: str | None  # a key column to add before writing, when the data has none


def plan_fit(
    config, overrides, kinds: dict[str, str | None], *, label_col: str | None, feature_cols: list[str] | None,
    key_col: str | None, raw_dir: str | None, engine: str, spark=None, client=None,
) -> FitPlan:
    """The fit's config: the estimator's arguments fill in what the config leaves unset; a
    column named both ways, differently, is refused (a written setting is never ignored).
    The DataFrame is written to raw_dir (default: a new folder under pipelines.source.path),
    and a written training.checkpoint_dir holds this fit's checkpoints in a new folder.

    kinds: column -> "numeric", "categorical" or None (a type shardline cannot use).
    """
    cfg = load_config(config, overrides)
    f, src = cfg.pipelines.features, cfg.pipelines.source
    if "format" in src.model_fields_set and src.format != "parquet":
        raise ConfigError(f"pipelines.source.format = {src.format!r}: an estimator's source is the DataFrame "
                          "given to fit (written as Parquet); leave it unset")
    label, key, generated = _label_and_key(f, kinds, label_col, key_col)
    update = _feature_columns(f, kinds, feature_cols, named={c for c in (label, key) if c})
    features = [*(update.get("pipelines.features.numeric") or f.numeric or []),
                *(update.get("pipelines.features.categorical") or f.categorical or []), *f.vectors]
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    fit = f"fit-{stamp}-{uuid.uuid4().hex[:8]}"  # this fit's folders' name
    if raw_dir is None:
        raw_dir = join(src.path, fit)
    raw = resolve(raw_dir, "pipelines.source.path", cluster_of(cfg, [engine], spark, client))
    update |= {"pipelines.source.format": "parquet", "pipelines.source.path": raw,
               "pipelines.features.label": label}
    if "checkpoint_dir" in cfg.training.model_fields_set:
        # Every fit is a new training job: a search's fits (or a refit) each get a folder of
        # their own under the one written, where the next would otherwise meet (and refuse)
        # the last one's checkpoints. Unset, each job has its own folder already.
        update["training.checkpoint_dir"] = join(cfg.training.checkpoint_dir, fit)
    if key is not None:
        update["pipelines.features.key"] = key
    cfg = load_config(cfg, update)
    columns = list(dict.fromkeys(c for c in (key, label, *features) if c))
    return FitPlan(cfg, raw, columns, generated)


def _label_and_key(f, kinds: dict[str, str | None], label_col: str | None,
                   key_col: str | None) -> tuple[str, str | None, str | None]:
    """(label, key, the key column to generate or None): the arguments or the config's."""
    written = f.model_fields_set
    label = _one("label_col", label_col, "pipelines.features.label", f.label if "label" in written else None) \
        or "label"
    _column(label, kinds, "label_col")
    key = _one("key_col", key_col, "pipelines.features.key", f.key if "key" in written else None)
    generated = None
    if key is None and not f.generate_key:
        generated = key = GENERATED_KEY
        if key in kinds:
            raise ConfigError(f"the DataFrame has a column '{key}' already: name its key with key_col")
    elif key is not None:
        _column(key, kinds, "key_col")
    return label, key, generated


def _feature_columns(f, kinds: dict[str, str | None], feature_cols: list[str] | None, named: set[str]) -> dict:
    """The config update naming the numeric and categorical features, from feature_cols or
    every column not named otherwise; {} when the config names them."""
    written = f.model_fields_set
    if feature_cols is not None and written & {"numeric", "categorical"}:
        raise ConfigError("feature_cols and pipelines.features.numeric/categorical both name the features: "
                          "give them once")
    if written & {"numeric", "categorical"}:
        return {}
    cols = list(feature_cols) if feature_cols is not None else \
        [c for c in kinds if c not in named and c not in f.vectors]
    for c in cols:
        _column(c, kinds, "feature_cols")
        if kinds[c] is None:
            raise ConfigError(f"column '{c}': its type is neither numeric nor text; leave it out of "
                              "feature_cols (or name it in pipelines.features.vectors with its length)")
    return {"pipelines.features.numeric": [c for c in cols if kinds[c] == "numeric"],
            "pipelines.features.categorical": [c for c in cols if kinds[c] == "categorical"]}


def _one(arg: str, given: str | None, setting: str, written: str | None) -> str | None:
    if given is not None and written is not None and given != written:
        raise ConfigError(f"{arg} = {given!r} but {setting} = {written!r}: give it once")
    return given if given is not None else written


def _column(name: str, kinds: dict, arg: str) -> None:
    if name not in kinds:
        raise ConfigError(f"{arg}: the DataFrame has no column '{name}' (its columns: {', '.join(kinds)})")


@dataclass(frozen=True)
class Fitted:
    """A trained, registered model and what scoring new rows with it needs."""

    model_uri: str  # pinned: models:/NAME/VERSION
    tracking_uri: str
    run_id: str
    transform_json: tuple[str, str, int]  # serving.inputs.Transform's fields: spec, statistics, width
    classification: bool

    @classmethod
    def of(cls, prepared, trained) -> Fitted:
        t = Transform.of(prepared.manifest)
        return cls(trained.model_uri, trained.tracking_uri, trained.run_id, (t.spec_json, t.stats_json, t.width),
                   prepared.manifest.feature_spec.task == "classification")

    @property
    def transform(self):
        return Transform(*self.transform_json)

    def check(self) -> None:
        """Its model checked on the driver before any task loads it (serving.job.ScoringJob.
        check_model): a version deleted since the fit, or a store that does not answer, is one
        line here, not a traceback from every task. Once per process and model."""
        key = (self.model_uri, self.tracking_uri)
        if key not in _CHECKED:
            ScoringJob.resolve(ServingConfig.model_validate({}), self.tracking_uri, "", model_uri=self.model_uri).check_model()
            _CHECKED.add(key)


_CHECKED: set[tuple[str, str]] = set()  # Fitted.check's models, checked already in this process



def label_name(config, overrides, label_col: str | None) -> str:
    """The label column a fit names (label_col, else the config's pipelines.features.label
    when written, else "label"): the name a separate `y` is given in the written DataFrame."""
    if label_col is not None:
        return label_col

    f = load_config(config, overrides).pipelines.features
    return f.label if "label" in f.model_fields_set and f.label else "label"


class SklearnParams:
    """scikit-learn's parameter protocol without importing scikit-learn: the parameters are
    `__init__`'s arguments, each stored as given under its own name (what `get_params`,
    `set_params` and `sklearn.base.clone` rely on). Fitted state ends in `_` and is set
    only by `fit` (so `sklearn.utils.validation.check_is_fitted` tells the two apart)."""

    # Parameters a clone shares with the original instead of deep-copying (a connection).
    _shared_params: tuple[str, ...] = ()

    @classmethod
    def _get_param_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return sorted(p.name for p in sig.parameters.values()
                      if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))

    def get_params(self, deep: bool = True) -> dict:
        out = {}
        for name in self._get_param_names():
            value = getattr(self, name)
            if deep and hasattr(value, "get_params") and not isinstance(value, type):
                out.update((f"{name}__{k}", v) for k, v in value.get_params().items())
            out[name] = value
        return out

    def set_params(self, **params):
        valid = self._get_param_names()
        nested: dict[str, dict] = {}
        for key, value in params.items():
            name, _, sub = key.partition("__")
            if name not in valid:
                raise ValueError(f"Invalid parameter {name!r} for estimator {type(self).__name__}. "
                                 f"Valid parameters are: {valid!r}.")
            if sub:
                nested.setdefault(name, {})[sub] = value
            else:
                setattr(self, name, value)
        for name, sub_params in nested.items():
            getattr(self, name).set_params(**sub_params)
        return self

    def __sklearn_clone__(self):
        """sklearn.base.clone's contract (a new, unfitted instance; each parameter deep-copied),
        except the shared ones: a clone of an estimator on a Dask client uses that client."""
        params = {k: v if k in self._shared_params else _clone_param(v)
                  for k, v in self.get_params(deep=False).items()}
        return type(self)(**params)

    def __sklearn_is_fitted__(self) -> bool:
        return getattr(self, "fitted_", None) is not None

    def __repr__(self) -> str:
        defaults = {p.name: p.default for p in inspect.signature(type(self).__init__).parameters.values()}
        shown = [f"{k}={v!r}" for k, v in self.get_params(deep=False).items()
                 if not _same(v, defaults.get(k, inspect.Parameter.empty))]
        return f"{type(self).__name__}({', '.join(shown)})"


def _clone_param(value):
    """As sklearn's clone(value, safe=False): an estimator is cloned, anything else deep-copied."""
    if hasattr(value, "__sklearn_clone__") and not isinstance(value, type):
        return value.__sklearn_clone__()
    if hasattr(value, "get_params") and not isinstance(value, type):
        from sklearn.base import clone  # an estimator given as a parameter: sklearn is there

        return clone(value)
    return copy.deepcopy(value)


def _same(a, b) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # noqa: BLE001 (a value whose == is not a bool, e.g. an array)
        return False
