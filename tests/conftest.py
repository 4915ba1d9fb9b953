"""Real engines, started once per session: one SparkSession, one MLflow store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.pipelines.config import PipelineConfig
from shardline.foundation.engine_config import SparkConfig

from .cli_inprocess import run_cli
from .mlflow_store import env_without_store

REPO = Path(__file__).resolve().parent.parent

pytest_plugins = ["tests.fixtures_s3", "tests.fixtures_connect", "tests.fixtures_clusters"]

# Spark's Python workers and Dask's worker processes must import `tests.*` helpers
# too; both inherit PYTHONPATH from this process. Set here, at import, because any
# test may be the one that starts the JVM (a fixture would be too late for some).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

# The suite starts about thirty JVMs, most of them for seconds (a CLI run, a refused
# setting, a cluster's master and workers). HotSpot's optimizing JIT (C2) and the G1
# collector's threads cost such a JVM about as much CPU as its work: measured here, a
# local[2] session that writes and reads a small Parquet table used 20 CPU-s by default
# and 11.6 with C1 only and the serial collector, 12 s of wall time against 10. Both
# are HotSpot flags that change speed, not behaviour. SPARK_SUBMIT_OPTS reaches every
# JVM that spark-submit starts (the session's, the CLI's, the Connect server's);
# SPARK_DAEMON_JAVA_OPTS a standalone master's and workers'. shardline never adds
# these flags (only its log4j setting): a user's long-lived JVMs want C2. A user's own
# value is kept, after ours.
TEST_JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
for _var in ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS"):
    if TEST_JVM_OPTS not in os.environ.get(_var, ""):  # once, if a child imports this again
        os.environ[_var] = f"{TEST_JVM_OPTS} {os.environ.get(_var, '')}".strip()


# The two tiers (tests/tiers.sh): `make test` runs every test not marked slow, cluster or
# multihost; `make test-all` all of them. The servers and clusters only the full tier starts
# are these fixtures': a test that asks for one, itself or through another fixture, is
# given its marker here, whatever it says, so the quick tier never starts one.
FULL_TIER_FIXTURES = {
    "connect_server": "slow", "connect_cli": "slow", "mlflow_server": "slow",
    "spark_standalone": "cluster", "dask_cli_cluster": "cluster",
}


FULL_TIER_MARKERS = ("slow", "cluster", "multihost")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers
def pytest_collection_modifyitems(items):
    for item in items:
        for fixture in FULL_TIER_FIXTURES.keys() & set(item.fixturenames):
            item.add_marker(FULL_TIER_FIXTURES[fixture])
    # `tests/tiers.sh all` runs both tiers in one pytest: the quick tier's tests first, then
    # the rest, each in its files' order, so the session's engines, servers and datasets
    # start once for both (a second pytest spent ~20 s starting and collecting them again).
    # Each test's tier is in the JUnit file (tests/tier_times.py reads it).
    for item in items:
        full = any(item.get_closest_marker(m) for m in FULL_TIER_MARKERS)
        item.user_properties.append(("tier", "full-only" if full else "quick"))
    if os.environ.get("SHARDLINE_TIERS") == "all":
        items.sort(key=lambda item: dict(item.user_properties)["tier"] == "full-only")  # stable


@pytest.fixture(autouse=True)
def _sys_path_as_found():
    """Each test leaves sys.path as it found it (what the session's fixtures added before it
    stays). `mlflow.pyfunc.load_model` puts the model's code folder first on sys.path and
    leaves it there, and a shardline model's folder holds a copy of shardline's engine
    packages: a process that multiprocessing starts later imports from the parent's path, so
    after the quick tier's tests, in the same pytest, bench score's processes imported that
    copy ("No module named 'shardline.benchmarks'")."""
    before = list(sys.path)
    yield
    sys.path[:] = before


# The class archive being written in the background (see jvm_class_archive).
_ARCHIVE: dict = {}


@pytest.fixture(scope="session", autouse=True)
def jvm_class_archive():
    """The suite's JVMs map Spark's classes from an archive (tests/jvm_archive.py).

    On a clone's first run a short Spark job writes it, about 30 s, half of them the JVM
    writing the file on one core: in a thread, beside the first tests, not before them.
    A JVM started before it is ready starts without it, only slower; every test set up
    after that gets the flags (`pytest_runtest_setup` below). The session waits for it at
    its end, so the next run has it even if this one was a single quick test."""
    from concurrent.futures import ThreadPoolExecutor

    from .jvm_archive import find_archive, write_archive

    archive, why = find_archive(REPO / ".pytest_cache" / "shardline", TEST_JVM_OPTS)
    if archive is None:
        _without_archive(why)
        yield
        return
    if archive.exists():
        _use_archive(archive)
        yield
        return
    with ThreadPoolExecutor(1, thread_name_prefix="jvm-archive") as pool:
        # The job's environment is copied here: only this thread changes os.environ.
        pending = pool.submit(write_archive, archive, TEST_JVM_OPTS, dict(os.environ))
        _ARCHIVE.update(archive=archive, pending=pending)
        yield
        pending.result()
        _use_archive_if_ready()  # if no test was set up after it was done: says why, if it failed


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _use_archive_if_ready()


def _use_archive_if_ready() -> None:
    pending = _ARCHIVE.get("pending")
    if pending is None or not pending.done():
        return
    del _ARCHIVE["pending"]  # once
    why = pending.result()
    if why:
        _without_archive(why)
    else:
        _use_archive(_ARCHIVE["archive"])


def _use_archive(archive: Path) -> None:
    from .jvm_archive import archive_flags

    flags = archive_flags(archive)
    for var in ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS"):
        if flags not in os.environ[var]:
            os.environ[var] = os.environ[var].replace(TEST_JVM_OPTS, f"{TEST_JVM_OPTS} {flags}", 1)


def _without_archive(why: str) -> None:
    import warnings

    warnings.warn(f"the suite's JVMs run without a class archive: {why}", stacklevel=2)


@pytest.fixture(scope="session")
def spark():
    from shardline.foundation.sessions import spark_session

    # local[2,1]: one attempt per task, said explicitly (shardline's own local masters retry
    # each task 4 times): the recovery tests place a fault and watch the whole job fail.
    # Python workers are forked from a daemon that imported torch, pyarrow and MLflow
    # (tests/preloaded_spark_daemon.py): Spark stops a Python worker idle for a minute and
    # never reuses one whose task failed, so most of the session's training and scoring
    # stages start fresh workers, each importing them anew (measured here: a stage after a
    # minute's pause, 7.6 CPU-s with PySpark's own daemon, 1.6 with this one).
    session = spark_session(SparkConfig(master="local[2,1]", shuffle_partitions=2,
                                        conf={"spark.python.daemon.module": "tests.preloaded_spark_daemon"}))
    yield session
    session.stop()


@pytest.fixture(scope="session", autouse=True)
def tracking_uri(tmp_path_factory) -> str:
    """A real MLflow store (SQLite) shared by the session's in-process tests.

    The session runs in a scratch directory: a SQLite store puts artifacts in
    ./mlruns, and Spark may leave files in the working directory.
    """
    root = tmp_path_factory.mktemp("session")
    os.chdir(root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    return uri


@pytest.fixture(scope="session")
def new_store():
    """`new_store(db)`: an empty MLflow store put at `db` (a path), its sqlite URI: a copy of one
    made once per session, not MLflow's table creation and migrations again (tests/mlflow_store.py).
    For a test whose job needs a store of its own; `new_store(db, "mlflow-artifacts:/0")` for
    an `mlflow server`'s backend store."""
    from .mlflow_store import copy_store, template

    return lambda db, default_artifacts=None: copy_store(template(), Path(db), default_artifacts)


def small_pipeline(tmp: Path, rows: int = 4000, **layout) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "dataset_dir": str(tmp / "dataset"),
            "source": {"format": "synthetic", "path": str(tmp / "raw"), "synthetic": {"rows": rows, "partitions": 2}},
            "layout": {"world_size": 2, **layout},
        }
    )


@pytest.fixture(scope="session")
def prepared(spark, tmp_path_factory) -> PipelineConfig:
    """A small synthetic dataset prepared once with Spark; tests must not modify it."""
    from shardline.engines import SparkEngine
    from shardline.pipelines.prepare import prepare

    cfg = small_pipeline(tmp_path_factory.mktemp("prepared"), rows=6000)
    prepare(SparkEngine(spark), cfg)
    return cfg


@pytest.fixture(scope="session")
def dask_client():
    from shardline.foundation.engine_config import DaskConfig
    from shardline.foundation.sessions import dask_client as make_client

    client = make_client(DaskConfig(n_workers=2, memory_limit="3GiB"))
    yield client
    cluster = client.cluster
    client.close()
    cluster.close()


@pytest.fixture(scope="session")
def on_session_dask(dask_client) -> tuple[str, ...]:
    """`--set` arguments that run a CLI command in this process (`shardline_here`) on the
    session's Dask scheduler instead of a LocalCluster of its own."""
    return ("--set", f"dask.address='{dask_client.scheduler.address}'")


@pytest.fixture(scope="session")
def engines(spark, dask_client):
    from shardline.engines import DaskEngine, SparkEngine

    return {"spark": SparkEngine(spark), "dask": DaskEngine(dask_client)}


def engine_for(request, launcher: str):
    """The session's engine named `launcher` (shardline.engines), starting only that one:
    the session's SparkSession or Dask client wrapped, or local processes."""
    from shardline.engines import ENGINES

    fixture = {"spark": "spark", "dask": "dask_client"}.get(launcher)
    return ENGINES[launcher](request.getfixturevalue(fixture)) if fixture else ENGINES[launcher]()


def absolute_paths(root: Path) -> list[str]:
    """`--set` arguments putting the quickstart's data paths under `root`, absolute, where
    its relative ones would go: tasks on other hosts (a cluster master, Spark Connect) are
    refused relative paths, since each would resolve them in its own working folder."""
    data = root / "shardline-data" / "quickstart"
    paths = {"pipelines.source.path": data / "raw", "pipelines.dataset_dir": data / "dataset",
             "training.checkpoint_dir": data / "checkpoints", "serving.output_dir": data / "scores"}
    return [a for k, v in paths.items() for a in ("--set", f"{k}='{v}'")]


def shardline(*args: str, cwd: Path, env: dict | None = None, timeout: int = 600):
    """Run the real CLI in a subprocess, as a user would: default store is cwd/mlflow.db."""
    base = env_without_store()
    return subprocess.run(
        [sys.executable, "-m", "shardline.jobs.cli", *args],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def shardline_here(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in this process (`jobs.cli.main`): the same output and exit code as
    `shardline()` without a Python start and its imports (~3 s a case on a 2-core machine).

    For a command refused before any engine starts, and for one that runs on the session's
    engines: the active SparkSession (the `spark` fixture's, which `foundation.spark_setup`
    reuses; request the fixture, or the CLI's own session becomes the session's) or the
    session's Dask scheduler (`--set dask.address=...`, with absolute paths; the CLI closes
    only its client). Not for Spark Connect: pyspark refuses a remote session beside the
    classic one (SESSION_ALREADY_EXIST); the `connect_cli` fixture runs those in one client
    process. Kills, the process's own exit codes (test_defaults.test_exit_codes_from_the_cli),
    spark-submit and a JVM's own settings stay with `shardline()`. The working folder and
    environment are put back afterwards, whatever the command set."""
    code, out, err = run_cli(list(args), cwd, env)
    return subprocess.CompletedProcess(["shardline", *args], code, out, err)
