"""Engine session factories: embedded local engines by default, a cluster by address."""

from __future__ import annotations

import os
import sys
from importlib import resources

from .config import DaskConfig, SparkConfig


def spark_session(cfg: SparkConfig):
    """Return the active SparkSession, or start one from `cfg`.

    Under spark-submit the session (and its master) already exists: we reuse it
    rather than override what the user submitted with.
    """
    # Workers must run the interpreter (and so the packages) of this process.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if cfg.master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active

    log4j = resources.files("pipelines") / "log4j2.properties"
    builder = SparkSession.builder.appName(cfg.app_name)
    # spark-submit starts the JVM first and hands us its gateway: its --master wins.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(cfg.master)
    settings = {
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{log4j}",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(cfg.shuffle_partitions),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # Bigger Arrow batches to Python UDFs: fewer round trips per row (default 10,000).
        "spark.sql.execution.arrow.maxRecordsPerBatch": "65536",
        # Per-worker model caches (serving) live only as long as the Python worker.
        "spark.python.worker.reuse": "true",
        **cfg.conf,
    }
    for k, v in settings.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not spark.sparkContext.master.startswith("local"):
        # Executors on other hosts import our packages from this zip (a driver-side
        # module they cannot import aborts the barrier stage: FACTS.md).
        spark.sparkContext.addPyFile(package_zip())
    return spark


def package_zip() -> str:
    """pipelines, training and serving as one zip, for executors and Dask workers."""
    global _ZIP
    if _ZIP is None:
        import tempfile
        import zipfile
        from pathlib import Path

        here = Path(__file__).resolve().parent.parent
        fd, path = tempfile.mkstemp(prefix="shardline-", suffix=".zip")
        os.close(fd)
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for pkg in ("pipelines", "training", "serving"):
                for f in sorted((here / pkg).rglob("*")):
                    if f.is_file() and "__pycache__" not in f.parts:
                        z.write(f, f.relative_to(here))
        _ZIP = path
    return _ZIP


_ZIP: str | None = None



def dask_client(cfg: DaskConfig):
    """A Dask client: on the scheduler at `cfg.address`, or on an embedded LocalCluster."""
    import logging

    from distributed import Client, LocalCluster

    # The P2P shuffle logs every shuffle's start and end as a warning.
    logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)
    if cfg.address:
        client = Client(cfg.address, timeout="30s")
        # Workers started elsewhere import our packages from this zip.
        client.upload_file(package_zip())
        return client
    cluster = LocalCluster(
        n_workers=cfg.n_workers,
        threads_per_worker=cfg.threads_per_worker,
        processes=True,
        memory_limit=cfg.memory_limit,
        dashboard_address=None,
    )
    return Client(cluster)
