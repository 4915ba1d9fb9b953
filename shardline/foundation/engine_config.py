"""The engines' config sections, `[spark]` and `[dask]`: every stage opens its engine from them.

Every field has a default that works on the embedded local engines.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from pydantic import Field

from .section import Section


class SparkConfig(Section):
    remote: str | None = Field(
        None,
        description="Spark Connect server URL (sc://host:port). None: the SPARK_REMOTE "
        "environment variable if set, else classic Spark on `master`.",
    )
    master: str = Field(
        "local[2]",
        description="Spark master URL of classic Spark. Under spark-submit its --master wins; "
        "on Spark Connect the server's master is used.",
    )
    app_name: str = Field("shardline", description="Spark application name (classic Spark).")
    shuffle_partitions: int = Field(
        4, ge=1, description="spark.sql.shuffle.partitions when nobody else set it; "
        "small is right for small data.",
    )
    conf: dict[str, str] = Field(
        default_factory=dict,
        description="Spark settings of this job. They win over spark-defaults.conf and a "
        "Connect server's session settings; under spark-submit its own settings win.",
    )
    connect_timeout_s: float = Field(
        10, gt=0, description="Seconds to wait for a Spark Connect server to accept a connection."
    )
    probe_timeout_s: float = Field(
        180,
        gt=0,
        description="Seconds for the environment probe (one task checking that executors "
        "can import shardline's dependencies; Connect and cluster masters) to get an executor.",
    )


class DaskConfig(Section):
    address: str | None = Field(
        None,
        description="Scheduler address (tcp://host:8786); none starts an embedded LocalCluster.",
    )
    n_workers: int = Field(2, ge=1, description="Workers of the embedded LocalCluster.")
    threads_per_worker: int = Field(1, ge=1, description="Threads per embedded worker.")
    memory_limit: str = Field("4GiB", description="Memory limit per embedded worker.")


def on_loopback(address: str) -> bool:
    """Whether a scheduler or master address (tcp://127.0.0.1:8786, spark://localhost:7077)
    is this machine's loopback: its workers, which must reach it there, run on this machine
    too, so paths on this machine are theirs as well. Read from the text, no DNS lookup."""
    host = urlsplit(address if "://" in address else f"tcp://{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: maybe another machine
        return False
