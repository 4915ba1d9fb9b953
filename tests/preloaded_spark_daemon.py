"""PySpark's Python worker daemon with torch, pyarrow and MLflow imported before it forks
(`spark.python.daemon.module = tests.preloaded_spark_daemon`), for the session's SparkSession
(tests/conftest.py) and a test's own JVM whose scoring tasks fail on purpose.

Spark never reuses a Python worker whose task failed, and stops one that was idle for a
minute: each retried attempt, and the first stage after a pause, is a fresh worker forked
from this daemon, and with PySpark's own daemon each imports torch and MLflow again
(seconds of CPU on a loaded 2-core machine). Forked from here they start with them
loaded, as training ranks forked from shardline's forkserver do. Everything else is
PySpark's daemon itself: the same fork per worker, the same protocol with the JVM; a worker
killed is as dead, a failed task as failed."""

import mlflow.pyfunc  # noqa: F401
import mlflow.pytorch  # noqa: F401
import pyarrow  # noqa: F401
import torch  # noqa: F401
from pyspark.daemon import manager

if __name__ == "__main__":
    manager()
