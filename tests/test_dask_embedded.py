"""The embedded Dask cluster (`foundation.sessions.dask_client` with no address) and the
environment: Dask's nanny passes its pre-spawn variables to a worker by setting them in
the driver's own environment, where a Spark JVM started later would inherit them. And a
scheduler in the driver's own process, given by its address: shardline's code zip goes to
its workers, never into the driver."""

from __future__ import annotations

import contextlib
import os
import socket
import warnings

import dask
import distributed  # noqa: F401  (registers its config: distributed.nanny.*)

from shardline.foundation.engine_config import DaskConfig
from shardline.foundation.sessions import close_quietly, dask_client


def _spawn_names() -> list[str]:
    return [*dask.config.get("distributed.nanny.pre-spawn-environ"), "PYTHONHASHSEED"]


def _exit_slowly() -> None:
    """In a worker: its process takes 6 s to exit (as an atexit hook of a user's library may),
    longer than the nanny's 4 s grace when the cluster closes."""
    import atexit
    import time

    atexit.register(time.sleep, 6)


def test_embedded_workers_get_dasks_variables_but_not_the_trim_threshold_and_the_driver_neither(monkeypatch, capfd):
    names = _spawn_names()
    assert {"MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS"} <= set(names)  # what Dask sets, as pinned
    for k in names:  # none set beforehand (a nanny restarted earlier in this process leaves them)
        monkeypatch.delenv(k, raising=False)
    # Another process's dashboard on Dask's default port: the scheduler moved its HTTP routes
    # elsewhere and said so in four lines of warning (#46). Held here unless someone already is.
    with socket.socket() as held:
        with contextlib.suppress(OSError):
            held.bind(("127.0.0.1", 8787))
            held.listen()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            client = dask_client(DaskConfig(n_workers=1, memory_limit="1GiB"))
    assert not [w for w in said if "already in use" in str(w.message)], [str(w.message) for w in said]
    assert "already in use" not in capfd.readouterr().err
    cluster, closed = client.cluster, False
    try:
        # The driver's environment is as it was ...
        assert {k: os.environ.get(k) for k in names} == dict.fromkeys(names)
        # ... the worker has Dask's variables (one thread for numpy's pools, the hash seed) ...
        (worker,) = client.run(lambda: {k: os.environ.get(k) for k in names}).values()
        assert worker["OMP_NUM_THREADS"] == "1" and worker["PYTHONHASHSEED"]
        # ... except the trim threshold, which slows every large allocation (shardline/foundation/sessions.py)
        assert worker["MALLOC_TRIM_THRESHOLD_"] is None

        # After a run that succeeded, the close says nothing: not the nanny's "Worker process
        # still alive after 4.0 seconds, killing" for a worker slow to exit, nor a heartbeat's
        # traceback (shardline.engines.open_dask closes a clean run this way).
        client.run(_exit_slowly)
        capfd.readouterr()
        close_quietly(client, cluster)
        closed = True
        err = capfd.readouterr().err
        assert "still alive" not in err and "Traceback" not in err and "heartbeat" not in err, err
    finally:
        if not closed:
            client.close()
            cluster.close()


def test_a_scheduler_in_this_process_gets_no_code_zip_only_its_workers_do(dask_client):
    """The session's LocalCluster runs its scheduler in this process, as a notebook's does.
    `client.upload_file` sent the zip to the scheduler too, which put it first on this
    process's path and re-imported pipelines, training and serving from it: a later model
    logged its code from the zip's temporary path and MLflow refused to copy it."""
    import sys

    from shardline import pipelines
    from shardline.foundation.sessions import dask_client as connect

    before = (pipelines.__file__, list(sys.path))
    client = connect(DaskConfig(address=dask_client.scheduler.address))
    try:
        on_workers = client.run(lambda: [p for p in __import__("sys").path if "shardline-code" in p])
    finally:
        client.close()
    assert len(on_workers) == 2 and all(on_workers.values()), on_workers
    assert (pipelines.__file__, sys.path) == before
