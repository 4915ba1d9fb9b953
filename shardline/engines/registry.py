"""The engines by name: the values of pipelines.engine, training.launcher, serving.engine and
sweep.engine name a class here."""

from __future__ import annotations

from shardline.foundation.errors import ConfigError

from .base import Engine
from .dask import DaskEngine
from .local import LocalEngine
from .spark import SparkEngine

ENGINES: dict[str, type[Engine]] = {e.name: e for e in (SparkEngine, DaskEngine, LocalEngine)}


def engine_class(name: str, setting: str = "engine") -> type[Engine]:
    """The class of the engine `name` (the value of `setting`); one line listing the valid names."""
    try:
        return ENGINES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"{setting} = {name!r}: no such engine (valid: {', '.join(ENGINES)})") from None


def frame_engine(df) -> type[Engine]:
    """The engine whose DataFrame `df` is (`shardline.prepare(source=df)`); ConfigError for another object."""
    for cls in ENGINES.values():
        if cls.owns_frame(df):
            return cls
    raise ConfigError(f"source: a Spark or Dask DataFrame is needed, not {type(df).__name__} "
                      "(a pandas DataFrame: dask.dataframe.from_pandas(df, npartitions=N))")


def given_engines(spark=None, client=None) -> dict[str, object]:
    """The API's `spark=` and `client=` by the name of the engine each is."""
    return {SparkEngine.name: spark, DaskEngine.name: client}


def given_pair(given: dict[str, object]) -> tuple[object, object]:
    """given_engines' mapping back as the API's (spark, client)."""
    return given[SparkEngine.name], given[DaskEngine.name]
