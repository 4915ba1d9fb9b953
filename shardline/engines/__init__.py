"""Engines as objects: Spark (classic and Connect), Dask and local processes, each one class
(shardline.engines.base.Engine) holding every stage's code for it in its own folder:
`spark/`, `dask/`, `local/`, each with `prepare`, `score` and `launch` as it runs them.

The API chooses an engine once, by the name a setting gives (registry), opens it (opened:
one per kind for the whole call, shared by its stages) and passes the object down; the
stages never ask for its name.
"""

from __future__ import annotations

from .base import Engine, Slots
from .dask import DaskEngine
from .local import LocalEngine
from .opened import Engines
from .registry import ENGINES, engine_class, frame_engine, given_engines, given_pair
from .spark import SparkEngine

__all__ = ["Engine", "Slots", "ENGINES", "engine_class", "frame_engine", "given_engines", "given_pair", "Engines",
           "SparkEngine", "DaskEngine", "LocalEngine"]
