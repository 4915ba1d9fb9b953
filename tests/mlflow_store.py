"""A new, empty MLflow SQLite store where a test's own store goes, copied from one made once.

Opening a store file that does not exist yet makes MLflow create its tables and run its
schema migrations: measured here 3.7 CPU-s a store (20 s of wall time beside other test
runs; opening a copy: 0.1 CPU-s), paid again by every test that gives a job a store of its own (a CLI run's default
cwd/mlflow.db, a config's `tracking_uri`, a server's backend store). A copy of a store that
went through that once, with nothing logged yet, is the same database: the same tables at
the same schema version, and only MLflow's "Default" experiment (id 0) in it. That
experiment's artifact location is the one thing written with a path: the copy gets the one
a store made in its own folder would have.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

_TEMPLATE: list[Path] = []


def env_without_store() -> dict[str, str]:
    """This process's environment less the session's MLflow store (MLFLOW_TRACKING_URI, set by
    conftest for in-process jobs): for a subprocess that must choose its own, as a user's would."""
    return {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}


def template() -> Path:
    """This process's template store, made on first use (removed when the process ends)."""
    if not _TEMPLATE:
        root = Path(tempfile.mkdtemp(prefix="shardline-mlflow-template-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _TEMPLATE.append(make_template(root))
    return _TEMPLATE[0]


def empty_store(folder: Path) -> Path:
    """folder/mlflow.db, the store a CLI command run in `folder` would create there; its path."""
    db = Path(folder) / "mlflow.db"
    copy_store(template(), db)
    return db


def make_template(folder: Path) -> Path:
    """An empty store in `folder`, its tables created by MLflow itself."""
    from mlflow.tracking import MlflowClient

    db = folder / "empty-mlflow.db"
    client = MlflowClient(f"sqlite:///{db}", registry_uri=f"sqlite:///{db}")
    client.search_experiments()  # the tracking store: creates the tables, runs the migrations
    client.search_registered_models()  # the registry store opens the same, now current, tables
    return db


def copy_store(template: Path, db: Path, default_artifacts: str | None = None) -> str:
    """The template as `db` (which must not exist yet); its sqlite URI.

    `default_artifacts`: where the Default experiment keeps artifacts, as the store's
    creator would have set it: `<db folder>/mlruns/0` (a client in that folder, MLflow's
    default) unless given (an `mlflow server` with --artifacts-destination: mlflow-artifacts:/0)."""
    if db.exists():
        raise FileExistsError(f"{db}: a store is already there")
    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, db)
    location = default_artifacts or str(db.parent / "mlruns" / "0")
    con = sqlite3.connect(db)
    try:
        with con:
            changed = con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                                  (location,)).rowcount
    finally:
        con.close()
    if changed != 1:
        raise RuntimeError(f"{template}: no Default experiment to move (MLflow's store layout changed?)")
    return f"sqlite:///{db}"
