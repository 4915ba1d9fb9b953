"""The embedded Dask cluster (`pipelines.engines.dask_client` with no address) and the
environment: Dask's nanny passes its pre-spawn variables to a worker by setting them in
the driver's own environment, where a Spark JVM started later would inherit them."""

from __future__ import annotations

import os

import dask
import distributed  # noqa: F401  (registers its config: distributed.nanny.*)

from pipelines.config import DaskConfig
from pipelines.engines import dask_client


def _spawn_names() -> list[str]:
    return [*dask.config.get("distributed.nanny.pre-spawn-environ"), "PYTHONHASHSEED"]


def test_embedded_workers_get_dasks_variables_but_not_the_trim_threshold_and_the_driver_neither(monkeypatch):
    names = _spawn_names()
    assert {"MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS"} <= set(names)  # what Dask sets, as pinned
    for k in names:  # none set beforehand (a nanny restarted earlier in this process leaves them)
        monkeypatch.delenv(k, raising=False)
    client = dask_client(DaskConfig(n_workers=1, memory_limit="1GiB"))
    try:
        # The driver's environment is as it was ...
        assert {k: os.environ.get(k) for k in names} == dict.fromkeys(names)
        # ... the worker has Dask's variables (one thread for numpy's pools, the hash seed) ...
        (worker,) = client.run(lambda: {k: os.environ.get(k) for k in names}).values()
        assert worker["OMP_NUM_THREADS"] == "1" and worker["PYTHONHASHSEED"]
        # ... except the trim threshold, which slows every large allocation (pipelines/engines.py)
        assert worker["MALLOC_TRIM_THRESHOLD_"] is None
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()
