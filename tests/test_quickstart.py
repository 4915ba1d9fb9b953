"""The quickstart end to end, at small size, through the CLI in a fresh directory.

The CLI runs in this process (`shardline_here`) on the session's SparkSession, which the
command takes as the active one: a subprocess would start a JVM and fresh Python workers of
its own (~25 s of the test's ~50 on an idle 2-core machine) for what other tests already
show a real process does (tests/test_clusters.py runs the quickstart config through a CLI
subprocess and spark-submit; tests/test_api.py's `run --json` is a real process and pipe).
The run keeps what makes it the quickstart: the shipped config as is, its relative paths
and default MLflow store resolved in the fresh directory (shardline_here starts each
command with no tracking URI, as a new process would).

The quick tier's end-to-end run on embedded Spark (`make test`; it was marked `slow` until
the tiers of #48): prepare -> train -> score, all on the session's `local[2]`."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from shardline.pipelines.manifest import load_manifest

from .conftest import REPO, shardline_here

QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"


def test_quickstart_end_to_end(spark, tmp_path):
    proc = shardline_here(
        "run",
        str(QUICKSTART),
        "--set",
        "pipelines.source.synthetic.rows=20000",
        "--set",
        "training.epochs=3",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]

    # Prepared dataset: every generated row in exactly one split, shards per rank.
    manifest = load_manifest(tmp_path / "shardline-data/quickstart/dataset")
    assert sum(s.rows for s in manifest.splits.values()) == 20000
    assert all(len(s.shards) % 2 == 0 for s in manifest.splits.values())

    # Scores: the test split, once each, with the contract's columns; read from the top,
    # the output's model=NAME/version=V/ directories add Hive partition columns.
    scores = pq.read_table(tmp_path / "shardline-data/quickstart/scores")
    assert scores.column_names == [
        "key", "prediction", "probabilities", "model_name", "model_version", "scored_at", "model", "version"
    ]
    test_keys = np.concatenate(
        [
            pq.read_table(tmp_path / "shardline-data/quickstart/dataset" / s.path).column("key")
            for s in manifest.splits["test"].shards
        ]
    )
    keys = scores.column("key").to_numpy()
    assert len(keys) == len(set(keys)) == manifest.splits["test"].rows
    assert set(keys) == set(test_keys)
    probs = np.array(scores.column("probabilities").to_pylist())
    assert probs.shape == (len(keys), manifest.statistics.num_classes)
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    assert (probs.argmax(1) == scores.column("prediction").to_numpy()).all()
    assert set(scores.column("model_version").to_pylist()) == {"1"}

    # MLflow: one run in cwd/mlflow.db, per-epoch metrics, a registered model that learnt.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("shardline-quickstart")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "3" and run.data.params["strategy"] == "ddp"
    for key in ("train_loss", "val_loss", "train_accuracy", "val_accuracy", "samples_per_s"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [0, 1, 2]
    val_acc = run.data.metrics["val_accuracy"]
    assert val_acc > 0.75, val_acc  # chance is 1/3, the majority class ~0.43
    version = client.get_model_version("shardline-quickstart", "1")
    assert version.run_id == run.info.run_id
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "curves.png" in artifacts

    # The summary says where everything is.
    out = proc.stdout
    assert run.info.run_id in out and "val accuracy" in out and "shardline ui" in out
