"""Concurrent runs that log the same dataset at once (a sweep's trials do) all keep it.

The store looks the dataset up, then inserts it; two runs racing through that pair
collide on the table's unique key and one failed its whole trial (a Dask sweep in CI).
Here four processes meet at a barrier before each of several logs, which made that
collision happen in most tries of this test before the fix."""

from __future__ import annotations

import multiprocessing
from types import SimpleNamespace


ROUNDS = 5
PROCESSES = 4


def _manifest(r: int):
    """Round r's dataset: what log_dataset_input reads of a manifest (its shards' sha256s, its sequence)."""
    return SimpleNamespace(splits={"train": SimpleNamespace(shards=[SimpleNamespace(sha256=f"round{r}")])}, sequence=r)


def _log_rounds(uri: str, dataset_dir: str, barrier, results) -> None:
    import mlflow

    from shardline.training.tracking import log_dataset_input

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("concurrent-inputs")
    for r in range(ROUNDS):
        with mlflow.start_run() as run:
            barrier.wait()
            try:
                log_dataset_input(_manifest(r), dataset_dir)
                results.put((r, run.info.run_id, "ok"))
            except Exception as e:  # the test reports what failed, in which round
                results.put((r, run.info.run_id, f"{type(e).__name__}: {str(e)[:160]}"))


def test_runs_logging_the_same_dataset_at_once_all_keep_it(tmp_path):
    from mlflow.tracking import MlflowClient

    from shardline.training.tracking import dataset_digest

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    dataset_dir = str(tmp_path / "dataset")
    # Created once, before the race on datasets. Through a client: this process's global
    # tracking URI belongs to the session's store, which later tests read.
    MlflowClient(uri).create_experiment("concurrent-inputs")
    # Processes forked from a fork server that imported MLflow's SQL store once (four spawned
    # interpreters each imported it again, ~2 CPU-s apiece).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store"])
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_log_rounds, args=(uri, dataset_dir, barrier, results)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in range(PROCESSES * ROUNDS)]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    failed = [g for g in got if g[2] != "ok"]
    assert not failed, failed

    client = MlflowClient(uri)
    for r, run_id, _ in got:
        inputs = client.get_run(run_id).inputs.dataset_inputs
        assert len(inputs) == 1
        assert inputs[0].dataset.digest == dataset_digest(_manifest(r))
        assert inputs[0].dataset.name == f"{dataset_dir}@{r}"
