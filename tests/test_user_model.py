"""A user's own model, loss and metrics, by import path (tests/usermodels/usernets, a
package as a user writes it): every strategy trains it as single-process training would,
a tracked job uses its loss and logs its metrics, and the driver's checks refuse what
cannot run in one line before any process starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from shardline.engines import LocalEngine
from shardline.foundation.errors import ConfigError
from shardline.pipelines.manifest import load_manifest
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import preflight, run_training
from shardline.engines.local.launch import launch_local
from shardline.training.models.check import check_callables, check_model
from shardline.training.models.factory import build_model, create_model
from shardline.training.models.inputs import ModelInputs, TensorInput
from shardline.training.strategies import strategy_for

from .defaults_helpers import small_dataset  # noqa: F401 (a fixture)
from .dist_helpers import INPUTS, relative_distance, train_steps, train_variants, unsynchronised
from .test_prepare_tensors import TOKENS, grid, pixels, png, tokens, typed_config, typed_raw

USERMODELS = Path(__file__).parent / "usermodels"
PACKAGE = str(USERMODELS / "usernets")
MODEL, LOSS = "usernets.nets:build", "usernets.losses:smoothed_ce"
ALWAYS_LINE = next(i for i, ln in enumerate((Path(PACKAGE) / "faults.py").read_text().splitlines(), 1)
                   if "this model always fails" in ln)
# Every strategy on 2 ranks (ps: a server and a worker), one after the other in one group.
STRATEGIES = {
    "ddp": {}, "fsdp": {}, "tensor": {}, "pipeline": {"micro_batches": 4}, "ps": {"servers": 1},
}
TOLERANCE = 1e-6  # SGD in fp32, as tests/test_equivalence.py
# SGD in bf16 autocast on the named-input model: measured 9.4e-6 (pipeline, torch 2.13 CPU);
# half of each batch alone lands at 1.0e-3, so test_equivalence.py's 1e-3 would have no teeth.
BF16_TOLERANCE = 1e-4
TYPED = "usernets.typed:build"  # forward(photo, grid, tokens): uint8, uint8, int32


@pytest.fixture(scope="module")
def typed_dataset(dask_client, tmp_path_factory) -> str:
    """96 rows of a PNG image (3 x 8 x 6), a uint8 grid [2, 3] and int32 tokens [8], prepared
    by Dask (tests/test_prepare_tensors.py's columns); its folder."""
    from shardline.engines import DaskEngine
    from shardline.pipelines.prepare import prepare

    tmp = tmp_path_factory.mktemp("typed-model")
    typed_raw(tmp / "raw", rows=96)
    cfg = typed_config(tmp)
    prepare(DaskEngine(dask_client), cfg)
    return cfg.dataset_dir


def test_every_strategy_trains_a_user_model_with_its_loss_as_single_process_does(monkeypatch):
    # Ranks import the user's package from the folder the job runs in (the cwd on sys.path).
    monkeypatch.chdir(USERMODELS)
    common = {"steps": 6, "batch": 32, "model": MODEL}
    variants = [{"strategy": s, "cfg": {**settings, "loss": LOSS}} for s, settings in STRATEGIES.items()]
    ranks = launch_local(train_variants, {**common, "variants": variants}, world_size=2, timeout_s=300)
    reference = train_steps(0, 1, {**common, "cfg": {"loss": LOSS}})
    for i, variant in enumerate(variants):
        for rank, weights in enumerate(ranks):
            distance = relative_distance(weights[i], reference)
            assert distance <= TOLERANCE, (variant["strategy"], rank, distance)
    # The tolerance has teeth: a lost gradient sync, or the task's loss in place of the
    # user's, lands outside it.
    assert relative_distance(unsynchronised({**common, "cfg": {"loss": LOSS}}, 2), reference) > 3 * TOLERANCE
    assert relative_distance(train_steps(0, 1, common), reference) > 3 * TOLERANCE


def test_every_strategy_trains_a_model_of_named_image_and_tensor_inputs_as_single_process_does(
    typed_dataset, monkeypatch,
):
    """The ranks read the prepared dataset's batches (PNGs decoded to uint8, tokens int32) and
    call the model with them as keyword arguments; a pipeline's first stage gets them too.
    bf16 autocast leaves the integer inputs as they are (the model asserts their dtypes)."""
    monkeypatch.chdir(USERMODELS)
    common = {"steps": 4, "batch": 16, "model": TYPED, "data": typed_dataset}
    variants = [{"strategy": s, "cfg": settings} for s, settings in STRATEGIES.items()]
    variants += [{"strategy": s, "cfg": {**STRATEGIES[s], "precision": "bf16"}} for s in ("fsdp", "pipeline")]
    ranks = launch_local(train_variants, {**common, "variants": variants}, world_size=2, timeout_s=300)
    references = {p: train_steps(0, 1, {**common, "cfg": {"precision": p}}) for p in ("fp32", "bf16")}
    for i, variant in enumerate(variants):
        precision = variant["cfg"].get("precision", "fp32")
        tolerance = BF16_TOLERANCE if precision == "bf16" else TOLERANCE
        for rank, weights in enumerate(ranks):
            distance = relative_distance(weights[i], references[precision])
            assert distance <= tolerance, (variant, rank, distance)
    # Teeth: half of each batch alone (a lost gradient sync) lands outside both tolerances.
    assert relative_distance(unsynchronised(common, 2), references["fp32"]) > 3 * BF16_TOLERANCE


def test_a_job_trains_a_user_model_with_its_loss_and_logs_its_metrics(small_dataset, tracking_uri, tmp_path):  # noqa: F811
    from mlflow.tracking import MlflowClient

    # The package found through training.code_paths (the job's folder is not its parent).
    cfg = TrainingConfig(
        launcher="local", world_size=2, strategy="pipeline", pipeline={"micro_batches": 2}, batch_size=32, epochs=2,
        model=MODEL, model_args={"width": 8, "depth": 2}, loss="usernets.losses:shifted_ce",
        metrics=["usernets.losses:ce", "usernets.losses:top1"], code_paths=[PACKAGE],
        checkpoint_dir=str(tmp_path / "ckpt"), timeout_s=120,
    )
    # The session's store: a store of its own would stay MLflow's global URI for later tests.
    tracking = TrackingConfig(tracking_uri=tracking_uri, experiment="user-model")
    result = run_training(cfg, tracking, small_dataset.dataset_dir, LocalEngine(), register=False)
    logged = MlflowClient(tracking.tracking_uri).get_run(result.run_id).data.metrics
    assert {"val_ce", "val_top1", "val_loss", "val_accuracy"} <= logged.keys(), sorted(logged)
    # val_loss is the user's loss (cross-entropy + 1) on the same rows val_ce covers at once.
    assert logged["val_loss"] - logged["val_ce"] == pytest.approx(1.0, abs=1e-4)
    assert logged["val_top1"] == pytest.approx(logged["val_accuracy"], abs=1e-6)
    # The final weights are the user's model's: the factory's module loads them.
    model = build_model(load_manifest(small_dataset.dataset_dir), cfg)
    model.load_state_dict(result.weights)
    assert type(model).__name__ == "Net" and "block1.up.weight" in result.weights


def test_a_built_in_name_is_its_import_path_with_the_settings_as_arguments():
    cfg = TrainingConfig(model="transformer", hidden=[16, 16], heads=2)
    by_name = create_model(INPUTS, cfg)
    by_path = create_model(INPUTS, cfg.model_copy(update={
        "model": "shardline.training.models.builtin:transformer", "model_args": {"hidden": [16, 16], "heads": 2},
    }))
    assert type(by_name) is type(by_path)
    for (k, a), (_, b) in zip(by_name.state_dict().items(), by_path.state_dict().items()):
        assert torch.equal(a, b), k
    # model_args override a built-in's settings.
    wide = create_model(INPUTS, cfg.model_copy(update={"model_args": {"hidden": [32]}}))
    assert wide[1].ff1.in_features == 32 and len(wide) == 3


def test_model_inputs_describe_the_manifest_and_round_trip_through_json(small_dataset):  # noqa: F811
    inputs = ModelInputs.from_manifest(load_manifest(small_dataset.dataset_dir))
    assert (inputs.task, inputs.num_classes, inputs.class_names) == ("classification", 3, ["0", "1", "2"])
    assert inputs.numeric == ["a", "b", "c"] and inputs.categorical == [] and inputs.feature_width == 3
    assert inputs.inputs["features"].shape == [3] and inputs.label.dtype == "int64"
    assert ModelInputs.model_validate_json(inputs.model_dump_json()) == inputs


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"model": "usernets.nets:plain", "strategy": "pipeline", "world_size": 2},
         "training.mesh.pp (a pipeline): training.model usernets.nets:plain is no nn.Sequential and declares no "
         "pipeline_layers()"),
        ({"model": "usernets.nets:plain", "strategy": "tensor", "world_size": 2},
         "training.mesh.tp 2: training.model usernets.nets:plain declares no tensor-parallel plan"),
        ({"model": "usernets.nets:plain", "activation_checkpointing": True},
         "training.activation_checkpointing: training.model usernets.nets:plain declares no recompute_units()"),
        ({"model": "usernets.nets:wrong_width"},
         "training.model usernets.nets:wrong_width: its output for a batch of 2 rows is [2, 4], but the "
         "dataset's task is 3 classes: the output must be [batch, 3]"),
        ({"model": "usernets.nets:not_a_module"},
         "training.model: usernets.nets:not_a_module returned a dict, not a torch.nn.Module"),
        ({"model_args": {"depth": 0}},
         "training.model: usernets.nets:build with training.model_args {'depth': 0} raised ValueError: "
         "depth must be at least 1, got 0"),
        ({"model_args": {"colour": "red"}},
         "training.model_args: usernets.nets:build does not take them as factory(inputs, **model_args) "
         "(got an unexpected keyword argument 'colour')"),
        ({"loss": "usernets.losses:one_argument"},
         "training.loss: usernets.losses:one_argument must take (output, target) (too many positional arguments)"),
        ({"loss": "usernets.losses:ce"},
         "training.loss: usernets.losses:ce returned a float, not a scalar tensor"),
        ({"metrics": ["usernets.losses:top1", "usernets.nets:build"]},
         "training.metrics[1]: usernets.nets:build fails on the model's output"),
        ({"metrics": ["usernets.losses:top1", "usernets.losses:top1"]},
         "training.metrics[1]: usernets.losses:top1 would be logged as val_top1, which another metric is"),
        # #53 item 16: the driver's check names the user's file and line, as a rank's line does.
        ({"model": "usernets.faults:raises_always"},
         "training.model usernets.faults:raises_always: its forward fails on a batch of the dataset's shape "
         f"(features [2, 3] float32) with ValueError: boom: this model always fails (at usernets/faults.py, "
         f"line {ALWAYS_LINE}, in forward)"),
        ({"model": "usernets.nets:NOT_CALLABLE"}, "training.model: usernets.nets:NOT_CALLABLE is not callable (it is a int)"),
        ({"model": "usernets.nowhere:build"},
         "training.model: cannot import module 'usernets.nowhere' (ModuleNotFoundError: No module named "
         "'usernets.nowhere')"),
    ],
)
def test_the_driver_refuses_what_cannot_run_in_one_line(small_dataset, settings, message):  # noqa: F811
    cfg = TrainingConfig(**{"model": MODEL, "code_paths": [PACKAGE], "world_size": 2, **settings})
    with pytest.raises(ConfigError) as e:
        preflight(cfg, small_dataset.dataset_dir)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# What a factory is told about typed_dataset (tests/test_prepare_tensors.py's columns).
TYPED_INPUTS = ModelInputs(
    task="classification", num_classes=3, class_names=["cat", "dog", "owl"], numeric=[], vectors={},
    categorical=[], cardinalities=[], label=TensorInput(dtype="int64", shape=[]), inputs={
        "tokens": TensorInput(dtype="int32", shape=[TOKENS]), "grid": TensorInput(dtype="uint8", shape=[2, 3]),
        "photo": TensorInput(dtype="uint8", shape=[3, 8, 6]),
    },
)


def test_the_driver_checks_a_model_of_named_inputs_on_zeros_of_their_dtypes():
    x, y = TYPED_INPUTS.sample_batch(2)
    assert {n: (t.dtype, list(t.shape)) for n, t in x.items()} == {
        "tokens": (torch.int32, [2, TOKENS]), "grid": (torch.uint8, [2, 2, 3]), "photo": (torch.uint8, [2, 3, 8, 6]),
    }
    assert y.dtype == torch.int64 and y.shape == (2,)
    cfg = TrainingConfig(model=TYPED, code_paths=[PACKAGE], strategy="pipeline", world_size=2)
    check_callables(cfg)
    model = create_model(TYPED_INPUTS, cfg)
    check_model(cfg, TYPED_INPUTS, model)
    strategy_for(cfg).check(cfg, model, TYPED_INPUTS)  # its layers compose too
    plain = cfg.model_copy(update={"model": "usernets.nets:plain", "strategy": "ddp"})
    with pytest.raises(ConfigError) as e:
        check_model(plain, TYPED_INPUTS, create_model(TYPED_INPUTS, plain))
    assert str(e.value) == (
        "training.model usernets.nets:plain: its forward fails on a batch of the dataset's shape (tokens [2, 8] "
        "int32, grid [2, 2, 3] uint8, photo [2, 3, 8, 6] uint8 as keyword arguments) with TypeError: "
        "Plain.forward() got an unexpected keyword argument 'tokens'"
    )


def test_the_registered_model_takes_decoded_arrays_of_the_declared_dtypes_and_shapes():
    from mlflow.exceptions import MlflowException

    from shardline.pipelines.manifest import TensorSpec
    from shardline.training.models.registered import typed_inputs

    tensors = {"grid": TensorSpec(column="grid", dtype="uint8", shape=[2, 3], encoding="raw"),
               "w": TensorSpec(column="w", dtype="bfloat16", shape=[2], encoding="raw")}
    got = typed_inputs(tensors, pd.DataFrame({"grid": [[[1, 2, 3], [4, 5, 6]]], "w": [[0.5, -1.0]]}))
    assert got["grid"].dtype == torch.uint8 and got["grid"].tolist() == [[[1, 2, 3], [4, 5, 6]]]
    assert got["w"].dtype == torch.bfloat16 and got["w"].tolist() == [[0.5, -1.0]]
    ok = {"grid": np.zeros((1, 2, 3), np.int64), "w": np.zeros((1, 2))}
    for rows, message in [
        ({"w": ok["w"]}, r"missing input 'grid' \(uint8 \[2, 3\] per row\)"),
        ({**ok, "grid": np.full((1, 2, 3), 256)}, "input 'grid' holds values that are not uint8"),
        ({**ok, "grid": np.zeros((1, 2, 3), np.float32)}, "input 'grid' holds values that are not uint8"),
        ({**ok, "w": np.zeros((1, 3))}, r"input 'w' has shape \[3\] per row; the model takes \[2\]"),
    ]:
        with pytest.raises(MlflowException, match=message):
            typed_inputs(tensors, rows)


def test_the_registered_model_decodes_base64_images_and_id_lists_as_prepare_does(tmp_path):
    """What `mlflow models serve` hands the model for JSON: the base64 of a PNG and an id list
    of any length. They decode to the loader's uint8 image and prepare's padded (or cut)
    sequence; a row prepare or the loader would reject is refused by input and row."""
    import base64

    from mlflow.exceptions import MlflowException

    from shardline.pipelines.manifest import TensorSpec
    from shardline.training.models.registered import typed_inputs

    spec = typed_config(tmp_path).features
    tensors = {"photo": TensorSpec(column="photo", dtype="uint8", shape=[3, 8, 6], encoding="image"),
               "tokens": TensorSpec(column="tokens", dtype="int32", shape=[TOKENS], encoding="raw")}
    b64 = [base64.b64encode(png(pixels(k))).decode() for k in (5, 11)]
    ids = [tokens(5), tokens(11)]  # 5 and 11 ids: padded with 0 and cut to 8
    got = typed_inputs(tensors, pd.DataFrame({"photo": b64, "tokens": ids}), spec)
    assert got["photo"].dtype == torch.uint8 and got["tokens"].dtype == torch.int32
    assert got["photo"].tolist() == [pixels(k).transpose(2, 0, 1).tolist() for k in (5, 11)]
    assert got["tokens"].tolist() == [(t + [0] * TOKENS)[:TOKENS] for t in ids]
    ok = {"photo": b64[:1], "tokens": ids[:1]}
    for rows, message in [
        ({**ok, "photo": ["not base64!"]}, r"input 'photo' row 0: not base64"),
        ({**ok, "photo": [base64.b64encode(b"GIF89a").decode()]}, "input 'photo' row 0: not a PNG or JPEG image"),
        ({**ok, "photo": [base64.b64encode(png(pixels(1, (4, 4)))).decode()]},
         r"input 'photo' row 0: the image is not 6 x 8 \(width x height\), and the dataset's images.photo.resize is off"),
        ({**ok, "tokens": [[1, 100]]}, r"input 'tokens' row 0: holds an id outside the vocabulary \(0 to 99\)"),
        ({**ok, "tokens": [[1, 2.5]]}, "input 'tokens' row 0: holds values that are not int32"),
    ]:
        with pytest.raises(MlflowException, match=message):
            typed_inputs(tensors, pd.DataFrame(rows), spec)


def test_a_pipeline_refuses_layers_that_do_not_compose_into_the_forward():
    cfg = TrainingConfig(model=MODEL, code_paths=[PACKAGE], strategy="pipeline", world_size=2)
    check_callables(cfg)
    model = create_model(INPUTS, cfg)
    model.pipeline_layers = lambda: ["features", "head", "block0"]  # another order than forward's
    check_model(cfg, INPUTS, model)  # the model alone is fine: its forward runs
    with pytest.raises(ConfigError, match="pipeline_layers\\(\\) run one after the other do not give"):
        strategy_for(cfg).check(cfg, model, INPUTS)  # the pipeline strategy's own check
    strategy_for(cfg).check(cfg, create_model(INPUTS, cfg), INPUTS)  # its own order passes


def _typed_rows(keys) -> dict[str, np.ndarray]:
    """The named inputs of rows `keys`, rebuilt from tests/test_prepare_tensors.py's
    generators (not read back from the shards): what prepare and the loader must give."""
    return {
        "tokens": np.array([(tokens(k) + [0] * TOKENS)[:TOKENS] for k in keys], np.int32),
        "grid": np.array([grid(k) for k in keys], np.uint8),
        "photo": np.stack([pixels(k).transpose(2, 0, 1) for k in keys]),
    }


def test_a_job_trains_scores_and_predicts_a_model_of_named_inputs(typed_dataset, spark, dask_client, tracking_uri,
                                                                   tmp_path):
    """Pipeline training of the named-input model with evaluation, batch scoring of the
    prepared dataset on Dask and on Spark, and the logged model's predict on decoded arrays."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from .serving_helpers import score

    from .serving_helpers import read_scores

    cfg = TrainingConfig(
        launcher="local", world_size=2, strategy="pipeline", pipeline={"micro_batches": 2}, batch_size=16, epochs=1,
        model=TYPED, code_paths=[PACKAGE], checkpoint_dir=str(tmp_path / "ckpt"), timeout_s=120,
    )
    tracking = TrackingConfig(tracking_uri=tracking_uri, experiment="typed-model")
    result = run_training(cfg, tracking, typed_dataset, LocalEngine(), register=False)  # scored by its runs:/ URI
    logged = MlflowClient(tracking_uri).get_run(result.run_id).data.metrics
    assert {"train_loss", "val_loss", "val_accuracy"} <= logged.keys() and logged["samples_per_s"] > 0, logged
    model = build_model(load_manifest(typed_dataset), cfg)
    model.load_state_dict(result.weights)
    model.eval()

    out = tmp_path / "scores"
    scored = score("dask", dask_client, result.model_uri, tracking_uri, typed_dataset, str(out))
    test_rows = load_manifest(typed_dataset).splits["test"].rows
    assert scored.rows == test_rows > 0
    # The scores keep the dataset's key column's own name (serving.key_column): `id` here.
    table = read_scores(out).sort_by("id")
    assert table.column_names == ["id", "prediction", "probabilities", "model_name", "model_version", "scored_at"]
    keys = table.column("id").to_pylist()
    rows = _typed_rows(keys)
    with torch.no_grad():
        want = torch.softmax(model(**{n: torch.from_numpy(a) for n, a in rows.items()}), 1).numpy()
    got = np.array(table.column("probabilities").to_pylist(), np.float32)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert table.column("prediction").to_pylist() == want.argmax(1).tolist()
    score("spark", spark, result.model_uri, tracking_uri, typed_dataset, str(tmp_path / "spark"))
    on_spark = read_scores(tmp_path / "spark").sort_by("id")
    for column in ("id", "prediction", "probabilities"):
        assert on_spark.column(column).to_pylist() == table.column(column).to_pylist(), column

    # The registered model predicts from decoded arrays (a dict, or a DataFrame of one array per row).
    pyfunc = mlflow.pyfunc.load_model(result.model_uri)
    # Registered with a signature (#46): its named inputs (any type: the model checks them) and outputs.
    signature = pyfunc.metadata.signature
    assert set(signature.inputs.input_names()) == {"id", *rows} and signature.inputs.optional_input_names() == ["id"]
    assert signature.outputs.input_names() == ["prediction", "prob_cat", "prob_dog", "prob_owl"]
    first = {n: a[:3] for n, a in rows.items()}
    frame = pd.DataFrame({n: list(a) for n, a in first.items()})
    for given in (first, frame):
        predicted = pyfunc.predict(given)
        assert predicted["prediction"].tolist() == want[:3].argmax(1).tolist()
        np.testing.assert_allclose(predicted[["prob_cat", "prob_dog", "prob_owl"]].to_numpy(), want[:3], atol=1e-5)
    with pytest.raises(Exception, match=r"input 'photo' has shape \[3, 4, 6\] per row; the model takes \[3, 8, 6\]"):
        pyfunc.predict({**first, "photo": first["photo"][:, :, :4]})

    # `mlflow models serve` of it, posted JSON as a client writes it: the image as the base64
    # of its PNG file, the sequence as its unpadded ids, the grid as nested lists.
    import base64

    from .serving_helpers import post, served

    records = [{"photo": base64.b64encode(png(pixels(k))).decode(), "tokens": tokens(k), "grid": grid(k)}
               for k in keys[:2]]
    with served(result.model_uri, tracking_uri, tmp_path) as base:
        answered = pd.DataFrame(post(f"{base}/invocations", {"dataframe_records": records})["predictions"])
    assert answered["prediction"].tolist() == want[:2].argmax(1).tolist()
    np.testing.assert_allclose(answered[["prob_cat", "prob_dog", "prob_owl"]].to_numpy(), want[:2], atol=1e-5)
