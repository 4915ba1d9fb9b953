"""An empty MLflow store for a CLI run's working folder, without MLflow's migrations.

A command run in a fresh folder creates its default store there (`mlflow.db`), and MLflow
creates a SQLite store by running every schema migration: 3-5 CPU-s, 7-35 s of wall time on
a loaded 2-core machine, paid again by each such run. `empty_store(folder)` puts there what
that first use writes, made once per process by MLflow itself: the tables at the current
schema, and no experiment (MLflow creates `Default` on the store's first use when it finds
none, with its artifacts under the folder's own ./mlruns, as in a store it made there).
For tests whose point is not the store's creation (other tests create theirs).
"""

from __future__ import annotations

import atexit
import shutil
import sqlite3
import tempfile
from pathlib import Path

_TEMPLATE: list[Path] = []


def empty_store(folder: Path) -> Path:
    """folder/mlflow.db, an empty store at MLflow's current schema; returns its path."""
    if not _TEMPLATE:
        _TEMPLATE.append(_make_template())
    target = Path(folder) / "mlflow.db"
    shutil.copyfile(_TEMPLATE[0], target)
    return target


def _make_template() -> Path:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = Path(tempfile.mkdtemp(prefix="shardline-mlflow-template-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    db = root / "mlflow.db"
    store = SqlAlchemyStore(f"sqlite:///{db}", str(root / "mlruns"))
    store.engine.dispose()
    # The Default experiment it made points into this folder: gone, so that each copy's
    # first use makes its own, as MLflow does in a store without experiments.
    with sqlite3.connect(db) as con:
        con.execute("DELETE FROM experiment_tags")
        con.execute("DELETE FROM experiments")
    con.close()
    return db
