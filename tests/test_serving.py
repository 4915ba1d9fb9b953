"""Batch scoring on real Spark, Dask and MLflow: rows, the ledger, incremental runs, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.foundation.errors import DataError, ShardlineError
from shardline.pipelines.manifest import load_manifest
from shardline.serving.ledger import LEDGER, output_lease, read_ledger
from .serving_helpers import score

from .serving_helpers import TRAINING, raw_table, read_scores, trained_model, version_dir, write_raw

COLUMNS = ["key", "prediction", "probabilities", "model_name", "model_version", "scored_at"]


@pytest.fixture(scope="module")
def model(prepared):
    return trained_model(prepared)


@pytest.fixture(scope="module")
def raw(prepared):
    return raw_table(prepared)


def _client(engine, spark, dask_client):
    return spark if engine == "spark" else dask_client


def _keys(output_dir) -> np.ndarray:
    return read_scores(output_dir).column("key").to_numpy()


@pytest.mark.parametrize("engine", ["spark", "dask"])
def test_prepared_split_scored_once_per_row(engine, request, prepared, model, tracking_uri, tmp_path):
    client = request.getfixturevalue(engine if engine == "spark" else "dask_client")
    out = tmp_path / "scores"
    result = score(engine, client, model.model_uri, tracking_uri, prepared.dataset_dir, str(out))

    manifest = load_manifest(prepared.dataset_dir)
    test = manifest.splits["test"]
    assert (result.rows, result.files_scored, result.files_skipped) == (test.rows, len(test.shards), 0)
    assert (result.model_name, result.model_version) == ("serving-test", model.model_version)

    # One output file per input shard in the version's directory, each named in its ledger.
    vdir = version_dir(out)
    assert vdir == out / "model=serving-test" / f"version={model.model_version}"
    ledger = read_ledger(vdir)
    assert len(ledger) == len(test.shards) == len(list(vdir.glob("scores-*.parquet")))
    scores = pq.read_table(vdir)  # a plain reader of the directory sees exactly the scores
    assert scores.column_names == COLUMNS
    # Read from the top, the model=/version= directories are Hive partition columns.
    whole = pq.read_table(out)
    assert whole.num_rows == test.rows and whole.column_names == [*COLUMNS, "model", "version"]
    keys = scores.column("key").to_numpy()
    assert len(keys) == len(set(keys)) == test.rows
    shard_keys = np.concatenate(
        [pq.read_table(Path(prepared.dataset_dir) / s.path).column("key") for s in test.shards]
    )
    assert set(keys) == set(shard_keys)
    probs = np.array(scores.column("probabilities").to_pylist())
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    assert (probs.argmax(1) == scores.column("prediction").to_numpy()).all()
    assert set(scores.column("model_version").to_pylist()) == {model.model_version}


def test_raw_input_same_scores_as_prepared_on_both_engines(spark, dask_client, prepared, model, raw, tracking_uri, tmp_path):
    # Raw rows transformed with the training statistics give the prepared features exactly.
    write_raw(raw, tmp_path / "raw", files=3)
    by_engine = {}
    for engine in ("spark", "dask"):
        out = tmp_path / f"scores-{engine}"
        r = score(engine, _client(engine, spark, dask_client), model.model_uri, tracking_uri,
                  str(tmp_path / "raw"), str(out))
        assert (r.rows, r.files_scored) == (raw.num_rows, 3)
        by_engine[engine] = read_scores(out).sort_by("key")
    a, b = by_engine["spark"], by_engine["dask"]
    assert a.column("key").to_numpy().tolist() == sorted(set(raw.column("key").to_numpy().tolist()))
    assert a.select(["key", "prediction", "probabilities"]).equals(b.select(["key", "prediction", "probabilities"]))

    prepared_out = tmp_path / "scores-prepared"
    score("dask", dask_client, model.model_uri, tracking_uri, prepared.dataset_dir, str(prepared_out))
    p = read_scores(prepared_out).sort_by("key")
    mine = a.filter(pa.compute.is_in(a.column("key"), value_set=p.column("key")))
    np.testing.assert_allclose(
        np.array(mine.column("probabilities").to_pylist()), np.array(p.column("probabilities").to_pylist()), atol=1e-6
    )


def test_incremental_scores_only_new_files(dask_client, model, raw, tracking_uri, tmp_path):
    half = raw.num_rows // 2
    src, out = tmp_path / "incoming", tmp_path / "scores"
    write_raw(raw.slice(0, half), src, files=2)
    first = score("dask", dask_client, model.model_uri, tracking_uri, str(src), str(out), incremental=True)
    assert (first.files_scored, first.files_skipped, first.rows) == (2, 0, half)
    before = {p.name: p.stat().st_mtime_ns for p in version_dir(out).glob("scores-*.parquet")}

    write_raw(raw.slice(half), src, files=2, start=2)  # new data arrives between passes
    second = score("dask", dask_client, model.model_uri, tracking_uri, str(src), str(out), incremental=True)
    assert (second.files_scored, second.files_skipped, second.rows) == (2, 2, raw.num_rows - half)
    assert {p.name: p.stat().st_mtime_ns for p in version_dir(out).glob("scores-*.parquet") if p.name in before} == before
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == raw.num_rows

    # Nothing new: nothing scored, and that is not an error.
    third = score("dask", dask_client, model.model_uri, tracking_uri, str(src), str(out), incremental=True)
    assert (third.files_scored, third.files_skipped, third.rows) == (0, 4, 0)

    # Without --incremental, an output holding other inputs' scores is refused.
    other = tmp_path / "other"
    write_raw(raw.slice(0, 100), other, files=1, start=9)
    with pytest.raises(DataError, match=r"not in this input .*--incremental"):
        score("dask", dask_client, model.model_uri, tracking_uri, str(other), str(out))


def test_alias_is_pinned_to_its_version(dask_client, model, prepared, tracking_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).set_registered_model_alias("serving-test", "champion", model.model_version)
    out = tmp_path / "scores"
    r = score("dask", dask_client, "models:/serving-test@champion", tracking_uri, prepared.dataset_dir, str(out))
    assert r.model_version == model.model_version
    assert {e["model_uri"] for e in read_ledger(version_dir(out)).values()} == {model.model_uri}


def test_second_job_on_same_output_is_refused(dask_client, model, prepared, tracking_uri, tmp_path):
    out = tmp_path / "scores"
    out.mkdir()
    with output_lease(out):  # a job holding the output, as another process would
        with pytest.raises(ShardlineError, match=r"scoring output .* is in use by shardline score \(host"):
            score("dask", dask_client, model.model_uri, tracking_uri, prepared.dataset_dir, str(out))
        assert [p.name for p in out.iterdir()] == ["_lease.json"]
    score("dask", dask_client, model.model_uri, tracking_uri, prepared.dataset_dir, str(out))


def test_other_models_scores_refused_unless_force_which_names_them(dask_client, model, prepared, tracking_uri, tmp_path):
    out = tmp_path / "scores"
    score("dask", dask_client, model.model_uri, tracking_uri, prepared.dataset_dir, str(out))
    # The same output, as if another model had written it.
    (out / "model=serving-test").rename(out / "model=other-model")
    for p in (out / "model=other-model").glob(f"*/{LEDGER}/*.json"):
        entry = json.loads(p.read_text())
        p.write_text(json.dumps({**entry, "model_name": "other-model"}))
    snapshot = sorted(str(p) for p in out.rglob("*"))
    with pytest.raises(DataError, match=r"holds scores of model other-model \(version .*\), not of serving-test; .*--force"):
        score("dask", dask_client, model.model_uri, tracking_uri, prepared.dataset_dir, str(out))
    assert sorted(str(p) for p in out.rglob("*")) == snapshot

    from shardline.serving.score import plan

    p = plan(model.model_uri, tracking_uri, prepared.dataset_dir, str(out), force=True)
    rows = load_manifest(prepared.dataset_dir).splits["test"].rows
    assert p.describe_discard() == [
        f"--force discards the scores of model other-model version {model.model_version}: "
        f"{len(p.units)} unit(s), {rows:,} rows in {out}/model=other-model/version={model.model_version}"
    ]
    r = score("dask", dask_client, model.model_uri, tracking_uri, prepared.dataset_dir, str(out), force=True)
    assert r.files_skipped == 0 and r.rows == rows
    assert not (out / "model=other-model").exists()
    assert {e["model_name"] for e in read_ledger(version_dir(out)).values()} == {"serving-test"}


def _corrupt(p: Path) -> None:
    p.write_bytes(b"PAR1 this is not parquet")


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_model", r"model models:/no-such-model/1: no registered model 'no-such-model' in MLflow"),
        ("missing_column", r"part-0001.parquet: missing feature column 'x3'"),
        ("wrong_type", r"part-0000.parquet: column 'x1' has type string"),
        ("empty", r"input is empty \(0 rows\)"),
        ("no_files", r"input is empty \(no Parquet files\)"),
        ("unreadable", r"part-0001.parquet: unreadable Parquet file"),
        ("foreign_output", r"holds files that are not shardline scores \(found 'notes.txt'\)"),
        ("no_split", r"dataset has no 'holdout' split"),
    ],
)
def test_bad_input_one_line_error_nothing_written(case, message, dask_client, model, prepared, raw, tracking_uri, tmp_path):
    src, out = tmp_path / "in", tmp_path / "scores"
    write_raw(raw.slice(0, 300), src, files=2)
    uri, split, inp = model.model_uri, "test", str(src)
    if case == "no_model":
        uri = "models:/no-such-model/1"
    elif case == "missing_column":
        pq.write_table(raw.slice(0, 10).drop_columns(["x3"]), src / "part-0001.parquet")
    elif case == "wrong_type":
        t = raw.slice(0, 10)
        pq.write_table(t.set_column(t.schema.get_field_index("x1"), "x1", t.column("x1").cast(pa.string())),
                       src / "part-0000.parquet")
    elif case == "empty":
        for p in src.iterdir():
            pq.write_table(raw.slice(0, 0), p)
    elif case == "no_files":
        shutil.rmtree(src)
        src.mkdir()
    elif case == "unreadable":
        _corrupt(src / "part-0001.parquet")
    elif case == "foreign_output":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "no_split":
        inp, split = prepared.dataset_dir, "holdout"
    with pytest.raises(ShardlineError, match=message) as e:
        score("dask", dask_client, uri, tracking_uri, inp, str(out), split=split)
    assert "\n" not in str(e.value)
    assert not out.exists() or [p.name for p in out.iterdir()] == ["notes.txt"]


def test_nan_feature_names_file_column_and_key(dask_client, model, raw, tracking_uri, tmp_path):
    src = tmp_path / "in"
    t = raw.slice(0, 50)
    x = t.column("x2").to_numpy().copy()
    x[7] = np.nan
    write_raw(t.set_column(t.schema.get_field_index("x2"), "x2", pa.array(x)), src, files=1)
    key = t.column("key")[7].as_py()
    with pytest.raises(DataError, match=rf"part-0000.parquet: column 'x2' is null, NaN or inf at key {key}"):
        score("dask", dask_client, model.model_uri, tracking_uri, str(src), str(tmp_path / "scores"))


def test_runs_uri_is_scored_under_its_run_id(dask_client, model, prepared, tracking_uri, tmp_path):
    uri = f"runs:/{model.run_id}/model"
    r = score("dask", dask_client, uri, tracking_uri, prepared.dataset_dir, str(tmp_path / "scores"))
    assert (r.model_name, r.model_version) == (uri, f"run-{model.run_id}")
    with pytest.raises(ShardlineError, match=r"model runs:/0123456789abcdef/model not found"):
        score("dask", dask_client, "runs:/0123456789abcdef/model", tracking_uri, prepared.dataset_dir,
              str(tmp_path / "other"))
    assert not (tmp_path / "other").exists()


def _model_copies(folders: set[str], run_id: str) -> set[Path]:
    """Entries of `folders` holding a download of the run's model (an MLmodel file naming the
    run, a few levels down): other processes' temp files are not this test's business."""
    found = set()
    for folder in folders:
        for entry in Path(folder).iterdir():
            try:
                for depth in ("MLmodel", "*/MLmodel", "*/*/MLmodel", "*/*/*/MLmodel"):
                    if any(run_id in m.read_text(errors="replace") for m in entry.glob(depth)):
                        found.add(entry)
                        break
            except OSError:  # another user's folder, or one removed while looked at
                continue
    return found


@pytest.mark.parametrize("engine", ["spark", "dask"])
def test_scoring_leaves_no_model_copy_in_the_temp_folder(engine, request, model, prepared, tracking_uri, tmp_path):
    import tempfile

    import mlflow

    from shardline.training.config import TrainingConfig
    from shardline.training.models.registered import load_torch_model, log_raw_model

    client = request.getfixturevalue(engine if engine == "spark" else "dask_client")
    # The temp folders of every process that loads the model: the workers' and this one's.
    if engine == "spark":
        temps = set(client.sparkContext.parallelize(range(2), 2).map(lambda _: tempfile.gettempdir()).collect())
    else:
        temps = set(client.run(tempfile.gettempdir).values())
    temps.add(tempfile.gettempdir())
    # A model no worker has loaded yet (a worker loads each model once), by a runs:/ URI:
    # MLflow copies those even from a local store (a models:/ one there it reads in place).
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment_id=mlflow.get_run(model.run_id).info.experiment_id)
    with mlflow.start_run() as run:
        log_raw_model(load_torch_model(model.model_uri), load_manifest(prepared.dataset_dir),
                      TrainingConfig(**TRAINING), None, pip_requirements=["torch"])
    before = _model_copies(temps, run.info.run_id)
    r = score(engine, client, f"runs:/{run.info.run_id}/model", tracking_uri, prepared.dataset_dir,
              str(tmp_path / "scores"))
    assert r.rows == load_manifest(prepared.dataset_dir).splits["test"].rows
    assert _model_copies(temps, run.info.run_id) - before == set()


def test_a_pickled_model_is_scored_only_when_allowed(on_session_dask, prepared, tracking_uri, tmp_path,
                                                     monkeypatch):
    """#46: a model logged by other code with mlflow.pytorch is unpickled by MLflow's loader,
    which runs whatever code its writer put in it. `shardline score` refuses it in one line,
    before any engine starts, unless serving.allow_pickled_models = true. One line (#53 item
    14): not MLflow's "Downloading artifacts" bar first, nor a note about other hosts (the
    session's scheduler is on loopback)."""
    from .conftest import shardline_here
    from .serving_helpers import register_wrapped

    uri = register_wrapped(prepared, tracking_uri, "pickled-by-others", lambda inner: inner)
    out = tmp_path / "scores"
    args = ["score", "--model", uri, "--output", str(out), "--engine", "dask", *on_session_dask,
            "--set", f"pipelines.dataset_dir='{prepared.dataset_dir}'"]
    env = {"MLFLOW_TRACKING_URI": tracking_uri}
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)  # as in a new process
    refused = shardline_here(*args, cwd=tmp_path, env=env)
    assert refused.returncode == 1, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith(f"error: model {uri} has MLflow's pytorch flavour") and \
        "serving.allow_pickled_models = true" in line, line
    assert not out.exists()

    allowed = shardline_here(*args, "--set", "serving.allow_pickled_models=true", cwd=tmp_path, env=env)
    assert allowed.returncode == 0, allowed.stderr
    assert read_scores(out).num_rows == load_manifest(prepared.dataset_dir).splits["test"].rows
