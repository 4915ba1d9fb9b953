"""The registered model is a pyfunc that `mlflow models serve` serves over HTTP on loopback:
raw rows in (the dataset's transform inside), the batch job's predictions out."""

from __future__ import annotations

import json
import urllib.error
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from shardline.pipelines.manifest import load_manifest
from .serving_helpers import score

from .serving_helpers import post, raw_table, read_scores, served, trained_model, write_raw


@pytest.mark.slow
def test_mlflow_models_serve_takes_raw_rows_and_agrees_with_the_batch_job(prepared, tracking_uri, dask_client, tmp_path):
    """Full tier only (`make test-all`, marker `slow`): `mlflow models serve` is a server of its own."""
    result = trained_model(prepared)
    with served(result.model_uri, tracking_uri, tmp_path) as base:
        # The same raw rows to the served model over HTTP and to the batch job.
        raw = raw_table(prepared).slice(0, 16)
        spec = load_manifest(prepared.dataset_dir).feature_spec
        rows = raw.select([spec.key, *spec.numeric, *spec.categorical, *spec.vectors]).to_pylist()
        url = f"{base}/invocations"
        got = pd.DataFrame(post(url, {"dataframe_records": rows})["predictions"])

        src = tmp_path / "raw"
        write_raw(raw, src, 1)
        score("dask", dask_client, result.model_uri, tracking_uri, str(src), str(tmp_path / "scores"))
        batch = read_scores(tmp_path / "scores").sort_by("key")
        probs = np.stack(batch.column("probabilities").to_numpy(zero_copy_only=False))
        assert list(got.columns) == ["key", "prediction", *(f"prob_{i}" for i in range(probs.shape[1]))]
        assert got["key"].tolist() == batch.column("key").to_pylist()
        assert got["prediction"].tolist() == batch.column("prediction").to_pylist()
        # The batch job stores float32 probabilities; the server sends the same float32s as JSON.
        answered = got[[f"prob_{i}" for i in range(probs.shape[1])]].to_numpy().astype(np.float32)
        np.testing.assert_allclose(answered, probs, rtol=1e-6, atol=1e-7)

        # A row the transform cannot take: HTTP 400 naming the column and the row.
        bad = [dict(rows[0]), dict(rows[1])]
        bad[1][spec.numeric[0]] = "twelve"
        with pytest.raises(urllib.error.HTTPError) as e:
            post(url, {"dataframe_records": bad})
        assert e.value.code == 400
        message = json.loads(e.value.read())["message"]
        assert repr(spec.numeric[0]) in message or spec.numeric[0] in message, message
        missing = [{k: v for k, v in r.items() if k != spec.categorical[0]} for r in rows[:2]]
        with pytest.raises(urllib.error.HTTPError) as e:
            post(url, {"dataframe_records": missing})
        assert e.value.code == 400 and spec.categorical[0] in json.loads(e.value.read())["message"]


def test_the_registered_model_signature_is_the_raw_schema_and_bad_rows_are_named(prepared, tracking_uri):
    import mlflow
    from mlflow.exceptions import MlflowException

    result = trained_model(prepared)
    mlflow.set_tracking_uri(tracking_uri)
    spec = load_manifest(prepared.dataset_dir).feature_spec
    info = mlflow.models.get_model_info(result.model_uri)
    assert info.signature.inputs.input_names() == [spec.key, *spec.numeric, *spec.categorical, *spec.vectors]
    assert info.signature.outputs.input_names()[0] == "prediction"
    assert "dataframe_split" in json.loads(Path(mlflow.artifacts.download_artifacts(
        f"{result.model_uri}/serving_input_example.json")).read_text())

    model = mlflow.pyfunc.load_model(result.model_uri)
    rows = raw_table(prepared).slice(0, 4).to_pandas()
    out = model.predict(rows.drop(columns=[spec.key]))
    assert "key" not in out.columns and len(out) == 4
    probs = out.filter(like="prob_").to_numpy()
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
    assert (out["prediction"].to_numpy() == probs.argmax(1)).all()

    bad = rows.copy()
    bad[spec.numeric[1]] = bad[spec.numeric[1]].astype(float)
    bad.loc[2, spec.numeric[1]] = float("nan")
    with pytest.raises(MlflowException, match=f"column '{spec.numeric[1]}' is null, NaN or inf at row 2"):
        model.predict(bad)


def test_the_served_model_takes_integer_columns_read_from_json_lines(prepared, tracking_uri, tmp_path):
    """Raw rows whose numeric columns hold integers (as pandas reads them from JSON lines:
    int64) are scored, as the same values as floats would be; not refused by the signature."""
    import mlflow

    result = trained_model(prepared)
    mlflow.set_tracking_uri(tracking_uri)
    spec = load_manifest(prepared.dataset_dir).feature_spec
    rows = raw_table(prepared).slice(0, 16).to_pandas()[[spec.key, *spec.numeric, *spec.categorical]]
    whole = rows.copy()
    for c in spec.numeric:
        whole[c] = (whole[c] * 3).round().astype("int64")
    whole.to_json(tmp_path / "raw.jsonl", orient="records", lines=True)
    read = pd.read_json(tmp_path / "raw.jsonl", lines=True)
    assert all(read[c].dtype == np.int64 for c in spec.numeric)  # the case MLflow refused

    model = mlflow.pyfunc.load_model(result.model_uri)
    got = model.predict(read)
    want = model.predict(read.astype({c: np.float64 for c in spec.numeric}))
    assert got["key"].tolist() == rows[spec.key].tolist()
    pd.testing.assert_frame_equal(got, want)
    # Categories that are integers are taken too (prepare takes any type, as text).
    codes = read.assign(**{spec.categorical[0]: np.arange(len(read), dtype=np.int64)})
    assert len(model.predict(codes)) == len(read)
