"""Lines said once or not at all (#46's noise): what an outage, MLflow, Dask, torch and
Spark would otherwise repeat, or say where nothing is wrong."""

from __future__ import annotations

from shardline.training.launchers import free_port


def test_an_outage_says_unlogged_checkpoints_once_and_counts_them(tmp_path, capsys, monkeypatch):
    """One line per checkpoint while MLflow was down was 30 lines in one run."""
    from shardline.training.tracking import MetricsReporter

    for k in ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"):
        monkeypatch.setenv(k, "0")  # a refused connection: no sleeping between MLflow's retries
    reporter = MetricsReporter(f"http://127.0.0.1:{free_port()}", "0" * 32)  # nothing listens there
    for step in (10, 20, 30):
        ckpt = tmp_path / f"ckpt-{step:09d}.pt"
        ckpt.write_bytes(b"weights")
        reporter.checkpoint(str(ckpt), step, artifact=True)
    kept = reporter.pending()
    said = [ln for ln in capsys.readouterr().err.splitlines() if "not logged" in ln]
    assert said == [
        "[shardline] MLflow unreachable: checkpoint ckpt-000000010.pt not logged as an artifact, nor those "
        "after it while MLflow is down (counted at the end)",
        "[shardline] MLflow was unreachable: 3 checkpoints in all not logged as artifacts (each is in "
        "training.checkpoint_dir)",
    ], said
    assert [e[2] for e in kept if e[0] == "tag"] == ["checkpoint_latest"] * 3  # the references are kept


def test_an_experiment_of_a_sqlite_store_keeps_artifacts_beside_the_store(tmp_path, new_store, monkeypatch):
    """#46: `mlruns/` appeared in the working folder when the store was a SQLite file elsewhere."""
    import mlflow

    from shardline.training.tracking import open_experiment

    import os

    # open_experiment points this process's MLflow at the store (its global and the variable):
    # the session's store again afterwards, for the tests that come after.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", os.environ["MLFLOW_TRACKING_URI"])
    uri = new_store(tmp_path / "store" / "mlflow.db")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    try:
        experiment_id = open_experiment(uri, "beside the store")
        with mlflow.start_run(experiment_id=experiment_id) as run:
            mlflow.log_text("logged", "note.txt")
        assert open_experiment(uri, "beside the store") == experiment_id  # found again, not made anew
    finally:
        mlflow.set_tracking_uri(None)  # then monkeypatch puts the variable back
    assert list(work.iterdir()) == []
    assert (tmp_path / "store" / "mlruns" / "beside%20the%20store" / run.info.run_id / "artifacts" / "note.txt").is_file()
