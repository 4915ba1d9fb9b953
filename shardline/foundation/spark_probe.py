"""Can Spark's executors run shardline? One cheap task says so, in one line, before any work.

On Spark Connect the executors are the server's: their Python is whatever the
server was started with (its PYSPARK_PYTHON), not this process's. On a cluster
master they run on other hosts. A package missing there would otherwise surface
as a traceback from a failed stage, after data was written.

Also here: Spark's errors as one line, and a job that gives up after a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import uuid
from contextlib import contextmanager

from .engine_config import SparkConfig
from .errors import ShardlineError
from .spark_setup import is_connect, master_as_written, spark_master

# What ranks and scoring tasks import on an executor (the last three are shipped by
# spark_setup as a zip; the others must be installed in the executors' Python).
REQUIRED = ("pyarrow", "numpy", "pandas", "torch", "mlflow", "optuna", "shardline.pipelines", "shardline.training", "shardline.serving")

_REPORTS: dict[int, dict] = {}


def needs_probe(spark) -> bool:
    """Local classic masters run our own interpreter (spark_setup.use_this_python), unless the
    session was given another one; everything else may not."""
    if is_connect(spark) or not spark_master(spark).startswith("local"):
        return True
    exe = spark.sparkContext.pythonExec  # classic only: Connect returned above
    return os.path.abspath(shutil.which(exe) or exe) != os.path.abspath(sys.executable)


def check_executors(spark, timeout_s: float | None = None) -> dict | None:
    """Run the probe once per session (None when the executors run this interpreter).

    Returns the executor's report: python, version, host, versions of torch/pyarrow.
    timeout_s: how long to wait for an executor (default: spark.probe_timeout_s's).
    """
    if not needs_probe(spark):
        return None
    if id(spark) in _REPORTS:
        return _REPORTS[id(spark)]
    if timeout_s is None:
        timeout_s = SparkConfig.model_fields["probe_timeout_s"].default
    df = spark.range(0, 1, numPartitions=1).mapInArrow(_probe(REQUIRED), "report string")
    try:
        with _quiet_task_failures(spark):
            rows = collect_within(
                spark, df, timeout_s,
                f"no Spark executor ran shardline's environment probe within {timeout_s:g} s "
                f"({_where(spark)}): has a worker registered with free cores? (spark.probe_timeout_s)",
            )
    except ShardlineError:
        raise
    except Exception as e:
        raise ShardlineError(_probe_failure(spark, spark_error_line(e))) from None
    report = json.loads(rows[0]["report"])
    _check_report(spark, report)
    _REPORTS[id(spark)] = report
    return report


def _probe(required: tuple[str, ...]):
    """The probe's mapInArrow function: an executor's Python, version, host, and which of
    `required` it cannot import. A closure, so cloudpickle sends it by value: it must load
    on an executor that has none of our packages."""

    def probe(batches):
        import importlib.util
        import json
        import socket
        import sys
        from importlib import metadata

        import pyarrow as pa

        for _ in batches:
            pass
        versions = {}
        for dist in ("torch", "pyarrow"):
            try:
                versions[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
        report = {
            "python": sys.executable,
            "version": list(sys.version_info[:2]),
            "host": socket.gethostname(),
            "missing": [m for m in required if importlib.util.find_spec(m) is None],
            "versions": versions,
        }
        yield pa.RecordBatch.from_pylist([{"report": json.dumps(report)}])

    return probe


def _check_report(spark, report: dict) -> None:
    """One line if the executors cannot import what a task needs or run another Python."""
    if report["missing"]:
        raise ShardlineError(
            f"Spark executors cannot import {', '.join(report['missing'])} (their Python is "
            f"{report['python']} on {report['host']}): {_fix(spark)}"
        )
    ours = list(sys.version_info[:2])
    if report["version"] != ours:
        raise ShardlineError(
            f"Spark executors run Python {'.'.join(map(str, report['version']))} "
            f"({report['python']}), this driver {'.'.join(map(str, ours))}: {_fix(spark)}"
        )


# Spark's loggers that report a failed task: each prints its Java stack and the Python one.
_TASK_FAILURE_LOGGERS = ("org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager")


@contextmanager
def _quiet_task_failures(spark):
    """While the probe runs, a failed probe task is said only in shardline's one line: Spark's
    own log of it (a Java and a Python stack, 60+ lines, from a session shardline did not
    start, with none of shardline's log settings) is held back. Classic sessions only: a
    Connect server's log is its own."""
    try:
        jvm = None if is_connect(spark) else spark.sparkContext._jvm  # classic only: a JVM here
        log4j = jvm.org.apache.logging.log4j if jvm is not None else None
        saved = {n: log4j.LogManager.getLogger(n).getLevel() for n in _TASK_FAILURE_LOGGERS} if log4j else {}
    except Exception:  # no log4j 2 behind this session: nothing to quiet
        saved = {}
    for name in saved:
        log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
    try:
        yield
    finally:
        for name, level in saved.items():
            log4j.core.config.Configurator.setLevel(name, level)


def describe_executors(report: dict) -> str:
    v = report["versions"]
    return (
        f"executors: Python {'.'.join(map(str, report['version']))} ({report['python']} on "
        f"{report['host']}), torch {v.get('torch', '?')}, pyarrow {v.get('pyarrow', '?')}"
    )


def _where(spark) -> str:
    return f"Spark Connect server, master {spark_master(spark)}" if is_connect(spark) else f"Spark master {master_as_written(spark)}"


def _fix(spark) -> str:
    if is_connect(spark):
        return (
            "start the Spark Connect server with PYSPARK_PYTHON set to a Python that has "
            "shardline's dependencies (its executors run that Python, not this one)"
        )
    return "set PYSPARK_PYTHON (or spark.pyspark.python) to a Python with shardline's dependencies on every executor host"


def _probe_failure(spark, line: str) -> str:
    missing = re.search(r"No module named '([\w.]+)'", line)
    if missing:
        return f"Spark executors cannot import {missing[1]} ({_where(spark)}): {_fix(spark)}"
    if "PYTHON_VERSION_MISMATCH" in line or "different version" in line:
        return f"Spark executors run another Python version than this driver ({line}): {_fix(spark)}"
    return f"Spark executors could not run shardline's environment probe ({_where(spark)}): {line}"


def collect_within(spark, df, timeout_s: float, timeout_message: str) -> list:
    """df.collect(), cancelled after `timeout_s` (a job waiting for executors waits forever)."""
    tag = f"shardline-{uuid.uuid4().hex[:12]}"
    box: dict = {}

    def run() -> None:
        spark.addTag(tag)  # per thread, on classic and Connect sessions alike
        try:
            box["rows"] = df.collect()
        except BaseException as e:
            box["error"] = e
        finally:
            spark.removeTag(tag)

    worker = threading.Thread(target=run, name="shardline-collect", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        spark.interruptTag(tag)
        worker.join(30)
        raise ShardlineError(timeout_message)
    if "error" in box:
        raise box["error"]
    return box["rows"]


def spark_error_line(e: BaseException) -> str:
    """A failed Spark job as one line: the Python exception a task raised, else Spark's reason.

    The text differs between classic (Py4J) and Connect (gRPC) errors, and holds Java
    stack frames and Python tracebacks; the user needs the one line at its root.
    """
    lines = str(e).splitlines()
    tracebacks = [i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln]
    if tracebacks:
        # A traceback's frames are indented; its exception line is the first that is not.
        for ln in lines[tracebacks[-1] + 1 :]:
            if ln.strip() and not ln[0].isspace():
                return _clean(ln)
    for ln in lines:
        if "Python worker exited unexpectedly" in ln:
            return _clean(ln[ln.index("Python worker") :].split(". Consider")[0])
        if "ExecutorLostFailure" in ln:  # a lost executor: its id and Spark's reason
            return _clean(ln[ln.index("ExecutorLostFailure") :])
    for ln in lines:
        ln = ln.strip()
        # Py4J's own wrapper line ("An error occurred while calling o75.collectToPython.")
        # says nothing; Spark's exception follows it.
        if ln and ln != "JVM stacktrace:" and not ln.startswith("at ") and not ln.startswith("An error occurred while calling"):
            return _clean(ln.removeprefix(": "))
    return type(e).__name__


def failed_task(e: BaseException) -> tuple[int, int, str] | None:
    """(task index in its stage, attempts, "host (executor id)") of the task that failed a
    Spark job, from Spark's report (classic and Connect alike), or None if it names none.
    A stage over `range(n, numPartitions=n)` runs task i on partition i: a unit or a rank."""
    text = str(e)
    failed = re.search(r"Task (\d+) in stage \S+ failed (\d+) times?", text)
    lost = re.search(r"Lost task (\d+)\.\d+ in stage \S+ \(TID \d+\) \((\S+) executor ([^)]+)\)", text)
    # A barrier stage is failed whole at its first failed task, in other words:
    # "Stage failed because barrier task ResultTask(<stage>, <partition>) finished unsuccessfully",
    # then the reason, "ExecutorLostFailure (executor <id> exited ...)" for a lost executor.
    barrier = re.search(r"barrier task (?:ResultTask|ShuffleMapTask)\(\d+, (\d+)\)", text)
    executor = re.search(r"ExecutorLostFailure \(executor (\S+) exited", text)
    if lost:
        where = f"{lost[2]} (executor {lost[3]})"
    else:
        where = f"executor {executor[1]}" if executor else "unknown host"
    if failed:
        return int(failed[1]), int(failed[2]), where
    if lost:
        return int(lost[1]), 1, where
    if barrier:
        return int(barrier[1]), 1, where
    return None


def _clean(line: str) -> str:
    return re.sub(r"\s*SQLSTATE: \w+\s*$", "", line.strip())[:400]
