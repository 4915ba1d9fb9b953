"""How shardline gets its SparkSession: Spark Connect or classic Spark, the user's settings first.

Spark Connect (`spark.remote = "sc://host:port"`, or the standard `SPARK_REMOTE`):
the server owns every JVM-level setting (master, UI, scheduler); shardline sets
only session (SQL) settings the server left unset, plus `[spark].conf`.

Classic Spark, precedence from highest:
  - started by shardline: `[spark]` in the config file, then `spark-defaults.conf`
    (in `SPARK_CONF_DIR`, else `$SPARK_HOME/conf`) and `--conf` in `PYSPARK_SUBMIT_ARGS`,
    then shardline's defaults;
  - under spark-submit (the JVM exists before our code runs): whatever spark-submit
    was given (`--master`, `--conf`, its properties file) and Spark's own defaults;
    `[spark].conf` and shardline's defaults fill in only session settings left unset.
What must be known when the JVM starts is set where it takes effect: the bind
address (`SPARK_LOCAL_IP`, local masters) and the log4j configuration
(`SPARK_SUBMIT_OPTS`, which comes before the user's `spark.driver.*JavaOptions` on
the java command line, so theirs win) are set only when shardline starts the JVM.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import warnings
from contextlib import contextmanager
from importlib import resources

from . import report
from .code_travel import ship_shardline_to_spark
from .engine_config import SparkConfig
from .environ import restored
from .errors import ConfigError, ShardlineError, first_line
from .redact import redact
from .spark_user_conf import user_spark_conf

# Imported inside the functions that use them: pyspark (only with a Spark session: Dask and local jobs never
# import it); foundation.spark_probe (a cycle: it imports this module).

# JVM-level settings: only when shardline starts the JVM, and only where the user set nothing.
CORE_DEFAULTS = {
    # Embedded runs need no web server on a port nobody asked for.
    "spark.ui.enabled": "false",
    # pyspark's launcher turns the bar on (it starts the JVM as a "shell"); shardline
    # prints its own stage lines, and the bar would garble them.
    "spark.ui.showConsoleProgress": "false",
    # Serving's per-worker model cache lives as long as the Python worker (Spark's default too).
    "spark.python.worker.reuse": "true",
    # A barrier stage with too few slots is retried every 15 s for 40 tries by default:
    # ten minutes before Spark says so. Time for late executors, then a clear error.
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "2s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "15",
}


def session_defaults(cfg: SparkConfig) -> dict[str, str]:
    """Session (SQL) settings: set on every kind of session, where the user set nothing."""
    return {
        "spark.sql.shuffle.partitions": str(cfg.shuffle_partitions),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # Bigger Arrow batches to Python UDFs: fewer round trips per row (default 10,000).
        "spark.sql.execution.arrow.maxRecordsPerBatch": "65536",
    }


def remote_url(cfg: SparkConfig) -> str | None:
    """The Spark Connect URL to use: `spark.remote`, else `SPARK_REMOTE`, else None (classic)."""
    url = cfg.remote or os.environ.get("SPARK_REMOTE") or None
    if url is None:
        return None
    where = _remote_source(cfg)
    if not url.startswith("sc://"):
        raise ConfigError(
            f"{where} {redact(url)!r}: shardline runs on a Spark Connect server at sc://host:port "
            f"(for embedded Spark leave it unset and use spark.master)"
        )
    from pyspark.sql.connect.client.core import DefaultChannelBuilder

    try:
        DefaultChannelBuilder(url)
    except Exception as e:  # PySparkValueError with the reason
        raise ConfigError(redact(f"{where} {url!r}: {first_line(e)}")) from None
    return url


def _remote_source(cfg: SparkConfig) -> str:
    return "spark.remote" if cfg.remote else "SPARK_REMOTE"


def start_spark(cfg: SparkConfig):
    """A SparkSession on Spark Connect or classic Spark; see the module docstring."""
    url = remote_url(cfg)
    spark = _connect(url, cfg) if url else _classic(cfg)
    ship_shardline_to_spark(spark)
    return spark


def adopt_session(spark) -> None:
    """A session the caller started (the Python API's `spark=`, classic or Connect): used as
    it is, its settings untouched, but for the Python its local workers run (use_this_python);
    our packages go to executors that need them, and executors whose Python shardline cannot
    see are checked (one probe task: foundation.spark_probe), before any job."""
    from .spark_probe import check_executors

    use_this_python(spark)
    ship_shardline_to_spark(spark)
    check_executors(spark)


def use_this_python(spark) -> None:
    """A classic local session whose Python workers would run pyspark's default `python3`
    runs this process's interpreter instead. pyspark takes `python3` when PYSPARK_PYTHON was
    unset as the session started: whatever `python3` is first on PATH, not the venv a script
    was started from by its full path (`.venv/bin/python job.py`, the venv not activated),
    so tasks failed after minutes on `No module named 'shardline'`. Left alone: Connect and
    cluster masters (their executors' Python is not this machine's to choose: they are
    probed), a spark.pyspark.python or a PYSPARK_PYTHON the session was given."""
    if is_connect(spark) or not spark_master(spark).startswith("local") or spark_setting(spark, "spark.pyspark.python"):
        return
    context = spark.sparkContext  # classic only: Connect returned above
    if context.pythonExec == "python3" and sys.executable:
        context.pythonExec = sys.executable


def is_connect(spark) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


def spark_setting(spark, key: str) -> str | None:
    """The value someone set (user, server or shardline), None when Spark's default applies.

    The same call on classic and Connect sessions; core settings are visible too.
    """
    return spark.conf.get(key, None)


def spark_master(spark) -> str:
    return spark_setting(spark, "spark.master") or "unknown"


def master_as_written(spark) -> str:
    """The master as the config wrote it (`local[2]`), not the `local[2,4]` shardline started
    it as (local_with_retries): what lines shown to the user name."""
    return _WRITTEN.get(id(spark)) or spark_master(spark)


def describe_spark(spark) -> str:
    """One line: where this session runs."""
    if is_connect(spark):
        return f"Spark Connect {_URLS.get(id(spark), 'server')} (master {spark_master(spark)})"
    return f"Spark master {master_as_written(spark)}"


_URLS: dict[int, str] = {}
_WRITTEN: dict[int, str] = {}  # id(session) -> its master as written, where shardline added retries


def connect_url(spark) -> str | None:
    """The sc:// URL a Connect session was opened with (None for classic Spark)."""
    return _URLS.get(id(spark))


# ---------------------------------------------------------------- Spark Connect


def _connect(url: str, cfg: SparkConfig):
    """Connect, failing in seconds when nothing (or no Connect server) answers.

    The Connect client retries an unreachable server for about ten minutes before
    it gives up; a plain TCP connect and a short retry policy for the first call
    answer in seconds. The client's own policy is put back for the job.
    """
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.client.core import DefaultChannelBuilder
    from pyspark.sql.connect.client.retries import DefaultPolicy

    where = _remote_source(cfg)
    parsed = DefaultChannelBuilder(url).url
    host, port = parsed.hostname, parsed.port or 15002
    reason = _unreachable(host, port, cfg.connect_timeout_s)
    if reason:
        raise ShardlineError(f"{where} {redact(url)}: cannot reach a Spark Connect server at {host}:{port} ({reason})")
    _quiet_client_logs()
    spark = SparkSession.builder.remote(url).getOrCreate()
    policies = spark.client.get_retry_policies()
    spark.client.set_retry_policies([DefaultPolicy(max_retries=3, max_backoff=1000)])
    try:
        with warnings.catch_warnings():  # the client warns before it raises: one line is ours
            warnings.simplefilter("ignore")
            spark.version  # the first call: a server that is not Spark Connect fails here
    except Exception as e:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spark.stop()  # now, with the short policy: at exit it would retry for minutes
        raise ShardlineError(
            f"{where} {redact(url)}: {host}:{port} does not answer as a Spark Connect server ({_grpc_reason(e)})"
        ) from None
    spark.client.set_retry_policies(policies)
    _URLS[id(spark)] = url
    for key, value in cfg.conf.items():  # the job's own settings win over the server's
        try:
            spark.conf.set(key, value)
        except Exception as e:
            raise ConfigError(
                f"spark.conf.{key}: cannot be set from a Spark Connect client ({first_line(e)}); "
                f"set it where the Connect server is started (--conf on start-connect-server.sh)"
            ) from None
    _fill_in(spark, session_defaults(cfg), explicit=_explicit_session(cfg))
    return spark


def _unreachable(host: str, port: int, timeout_s: float) -> str | None:
    """Why nothing accepts a TCP connection at host:port, or None when something does."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        if isinstance(e, TimeoutError) or e.strerror is None:
            return f"no answer in {timeout_s:g} s"
        return e.strerror
    return None


def _grpc_reason(e: BaseException) -> str:
    details = re.search(r'details = "([^"]*)"', str(e))
    return details[1][:300] if details else first_line(e)


def _quiet_client_logs() -> None:
    """The Connect client logs a failed query as a JSON line before raising it; shardline
    reports errors itself, as one line."""
    from pyspark.logger import PySparkLogger

    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
        PySparkLogger.getLogger(name).setLevel(logging.CRITICAL)


# ---------------------------------------------------------------- classic Spark


def _classic(cfg: SparkConfig):
    from pyspark.sql import SparkSession

    # Workers run the interpreter (and so the packages) of this process unless told otherwise.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    active = SparkSession.getActiveSession()
    if active is not None:
        use_this_python(active)
        return active
    builder = SparkSession.builder
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM
    if submitted:
        # Its settings are in the JVM already; what it was not given stays Spark's default.
        # [spark].conf fills in what is left unset, like shardline's defaults.
        with _context_start("spark-submit"):
            spark = builder.getOrCreate()
        _fill_in(spark, session_defaults(cfg))
        late = _fill_in(spark, cfg.conf)
        _ctrl_c_to_this_process(spark)
        if late:
            raise ConfigError(
                f"spark.conf.{late[0]}: a JVM setting cannot be set once spark-submit has "
                f"started Spark; pass it to spark-submit as --conf {late[0]}={cfg.conf[late[0]]}"
            )
        return spark

    user = user_spark_conf()  # spark-defaults.conf, PYSPARK_SUBMIT_ARGS
    master = cfg.master if "master" in cfg.model_fields_set else user.get("spark.master", cfg.master)
    written, master = master, local_with_retries(master, {**user, **cfg.conf})
    _check_standalone_master(master, cfg.connect_timeout_s)
    builder = builder.master(master)
    if "app_name" in cfg.model_fields_set or "spark.app.name" not in user:
        builder = builder.appName(cfg.app_name)
    for key, value in CORE_DEFAULTS.items():
        if key not in user:
            builder = builder.config(key, value)
    for key, value in cfg.conf.items():
        builder = builder.config(key, value)
    with _launch_env(local=master.startswith("local")), _context_start("spark.conf"):
        spark = builder.getOrCreate()
    if written != master:
        _WRITTEN[id(spark)] = written
    _fill_in(spark, session_defaults(cfg), explicit={**_explicit_session(cfg), **cfg.conf})
    return spark


def _ctrl_c_to_this_process(spark) -> None:
    """Under spark-submit the JVM is this process's parent, and a terminal's Ctrl-C (SIGINT to
    the foreground group) reached it too: it stopped Spark and exited while this process was
    still cancelling the job, and this process's output, which spark-submit's JVM carries,
    went with it: exit 130 without the command's "aborted" line (#53). pyspark starts a JVM of
    its own ignoring SIGINT (java_gateway's preexec_fn), so that Python alone answers Ctrl-C:
    the same is asked here of the JVM spark-submit started. The command then cancels its job,
    says "aborted" and exits 130, and spark-submit exits with that code (its PythonRunner
    exits with the Python driver's)."""
    jvm = spark.sparkContext._jvm  # classic only: called under spark-submit, whose JVM this is
    try:
        jvm.sun.misc.Signal.handle(jvm.sun.misc.Signal("INT"), jvm.sun.misc.SignalHandler.SIG_IGN)
    except Exception as e:  # noqa: BLE001 - a JVM without sun.misc.Signal: Spark's own handling stays
        report.warn(f"spark-submit: Ctrl-C stops Spark's JVM before this command can ({first_line(e)})")


@contextmanager
def _context_start(given_by: str):
    """A SparkContext that fails to start (a missing --archives file, a bad --conf value)
    surfaces as a Py4J error wrapping a Java stack: say its Java cause in one line, and
    where the setting that caused it was given."""
    try:
        yield
    except Exception as e:
        java = getattr(e, "java_exception", None)  # py4j.protocol.Py4JJavaError
        if java is None:
            raise
        cause = java
        while cause.getCause() is not None:
            cause = cause.getCause()
        raise ConfigError(
            f"{given_by}: Spark could not start ({cause.toString()[:300]}); check the files and "
            "settings given to it (--archives, --files, --py-files, --jars, --conf)"
        ) from None


LOCAL_TASK_ATTEMPTS = 4  # Spark's own spark.task.maxFailures default on a cluster


def local_with_retries(master: str, conf: dict[str, str]) -> str:
    """`local[N]` as `local[N,F]`: local mode ignores spark.task.maxFailures and tries each
    task once, so one killed Python worker failed a whole scoring job. F is the user's
    spark.task.maxFailures if set, else 4 (a cluster's default); a master that already says
    F (`local[2,1]` for no retries) is kept as written."""
    m = re.fullmatch(r"local(?:\[(\d+|\*)\])?", master.strip())
    if not m:
        return master
    attempts = conf.get("spark.task.maxFailures", str(LOCAL_TASK_ATTEMPTS))
    return f"local[{m[1] or 1},{attempts}]"


def _check_standalone_master(master: str, timeout_s: float) -> None:
    """A spark:// master nobody answers at: Spark would try to register for about a
    minute, then fail with a Java stack trace."""
    if not master.startswith("spark://"):
        return
    reasons = []
    for hostport in master.removeprefix("spark://").split(","):  # HA: any of the masters
        host, _, port = hostport.partition(":")
        reason = _unreachable(host, int(port) if port.isdigit() else 7077, timeout_s)
        if reason is None:
            return
        reasons.append(reason)
    raise ShardlineError(f"spark.master {master}: no Spark master answers there ({reasons[0]})")


def _explicit_session(cfg: SparkConfig) -> dict[str, str]:
    """Session settings the config file names itself: they win like [spark].conf does."""
    if "shuffle_partitions" in cfg.model_fields_set:
        return {"spark.sql.shuffle.partitions": str(cfg.shuffle_partitions)}
    return {}


def _fill_in(spark, defaults: dict[str, str], explicit: dict[str, str] | None = None) -> list[str]:
    """Set `explicit` settings, and `defaults` only where the session has no value yet.

    Returns the defaults that could not be set: JVM-level settings of a running Spark.
    """
    explicit = explicit or {}
    for key, value in explicit.items():
        if spark.conf.get(key, None) != value:
            spark.conf.set(key, value)
    refused = []
    for key, value in defaults.items():
        if key not in explicit and spark.conf.get(key, None) is None:
            try:
                spark.conf.set(key, value)
            except Exception:  # CANNOT_MODIFY_CONFIG
                refused.append(key)
    return refused


@contextmanager
def _launch_env(local: bool):
    """Environment the JVM reads when it starts; put back afterwards, so that a
    spark-submit this process runs later is not steered by it."""
    log4j = resources.files("shardline.foundation") / "log4j2.properties"
    with restored(("SPARK_LOCAL_IP", "SPARK_SUBMIT_OPTS")):
        if local:
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        opts = os.environ.get("SPARK_SUBMIT_OPTS", "")
        if "log4j2.configurationFile" not in opts:
            os.environ["SPARK_SUBMIT_OPTS"] = f"{opts} -Dlog4j2.configurationFile=file:{log4j}".strip()
        yield
