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
