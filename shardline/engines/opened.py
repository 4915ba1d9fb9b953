"""The engines one API call uses, opened on first use and closed at its end."""

from __future__ import annotations

from contextlib import ExitStack

from .base import Engine
from .registry import engine_class, given_engines


class Engines:
    """The engines one API call uses, each opened on first use (Engine.open), one of a kind
    shared by the call's stages: the caller's own SparkSession or Dask client when given
    (used as they are, never stopped or closed here), else started from the config. What was
    started here is closed at the end (an embedded Dask cluster; a SparkSession stays the
    process's active session, as pyspark keeps it).

    ranks: (engine name, world size) of the call's training, when it has one: the slots a
    barrier stage needs are checked as soon as that engine opens (Engine.open's `ranks`).
    """

    def __init__(self, cfg, spark=None, client=None, ranks: tuple[str, int] | None = None):
        self._cfg, self._ranks = cfg, ranks
        self._given = given_engines(spark, client)
        self._open: dict[str, Engine] = {}
        self._stack = ExitStack()

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)

    def get(self, name: str, setting: str = "engine") -> Engine:
        """The engine `name` (the value of `setting`), opened now if this call has not yet."""
        if name not in self._open:
            cls = engine_class(name, setting)
            ranks = self._ranks[1] if self._ranks and self._ranks[0] == name else None
            engine = cls.open(self._cfg, self._given.get(name), ranks)
            self._stack.push(lambda kind, *_: engine.close(failed=kind is not None))
            self._open[name] = engine
        return self._open[name]
