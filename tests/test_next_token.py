"""A language model's data and task (#37 item 3): a Parquet table of token sequences prepared
with `pipelines.features.task = "next_token"` (no label column: the tokens are the target)
on Spark and Dask alike, the loader's label (the tokens, pads ignored), the next-token loss,
and the built-in decoder trained by fsdp, tensor and pipeline as single-process training."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from shardline.engines import LocalEngine
from shardline.pipelines.checks import check_prepare
from shardline.pipelines.config import PipelineConfig
from shardline.foundation.errors import ConfigError
from shardline.pipelines.manifest import TensorSpec, load_manifest
from shardline.engines.local.launch import launch_local
from shardline.training.loader.reader import ShardLoader
from shardline.training.models.inputs import ModelInputs, TensorInput
from shardline.training.models.decoder import decoder
from shardline.training.task import batch_sums, figures, next_token_loss, next_token_rows, task_loss

from .dist_helpers import relative_distance, train_steps, train_variants, unsynchronised
from .test_engines_equal import engine_dirs, prepare_both

ROWS, LENGTH, VOCAB, PAD = 64, 16, 32, 0
TOLERANCE = 1e-6  # SGD in fp32, as tests/test_equivalence.py


def sequences() -> list[list[int]]:
    """Token ids 1..VOCAB-1, 4 to 23 long: shorter than LENGTH is padded, longer cut."""
    rng = np.random.default_rng(0)
    return [rng.integers(1, VOCAB, rng.integers(4, 24)).tolist() for _ in range(ROWS)]


def token_config(tmp: Path, **features) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "dataset_dir": str(tmp / "dataset"),
        "source": {"format": "parquet", "path": str(tmp / "raw")},
        # The label left out: the only token column is the target.
        "features": {"key": "id", "task": "next_token", "tensors": {
            "tokens": {"dtype": "int32", "shape": [LENGTH], "pad_id": PAD, "truncate": True, "vocab_size": VOCAB},
        }, **features},
        "layout": {"world_size": 2, "rows_per_row_group": 8, "target_shard_bytes": 2048},
    })


def write_tokens(raw: Path, extra: dict | None = None) -> None:
    raw.mkdir(parents=True)
    table = pa.table({"id": list(range(ROWS)), "tokens": sequences(), **(extra or {})})
    pq.write_table(table.slice(0, ROWS // 2), raw / "part-0.parquet")
    pq.write_table(table.slice(ROWS // 2), raw / "part-1.parquet")


@pytest.fixture(scope="module")
def lm(engines, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("lm")
    write_tokens(tmp / "raw")
    cfg = token_config(tmp)
    return {"fingerprints": prepare_both(engines, cfg), "dirs": engine_dirs(cfg)}


def test_spark_and_dask_prepare_token_sequences_as_their_own_target(lm):
    got = lm["fingerprints"]
    assert len(got["spark"]["shards"]) >= 4
    assert got["spark"] == got["dask"]
    m = load_manifest(lm["dirs"]["spark"])
    # No label column: the manifest's label is the token column itself, int32 as stored.
    tokens = TensorSpec(column="tokens", dtype="int32", shape=[LENGTH], encoding="raw")
    assert m.tensors == {"tokens": tokens, "label": tokens}
    assert {f["name"]: f["type"] for f in m.arrow_schema} == {"id": "int64", "tokens": f"fixed_size_binary[{4 * LENGTH}]"}
    assert m.feature_spec.label == "tokens" and m.statistics.num_classes == VOCAB
    inputs = ModelInputs.from_manifest(m)
    assert (inputs.task, inputs.output_width, inputs.class_names) == ("next_token", VOCAB, [])
    assert inputs.inputs == {"tokens": TensorInput(dtype="int32", shape=[LENGTH])}
    assert inputs.label == TensorInput(dtype="int64", shape=[LENGTH])

    # The loader yields the tokens twice: as the input, and as the label with pads -100.
    m = load_manifest(lm["dirs"]["dask"])
    padded = {tuple((s + [PAD] * LENGTH)[:LENGTH]) for s in sequences()}
    seen = 0
    for rank in range(2):
        loader = ShardLoader(m, lm["dirs"]["dask"], "train", rank, 2, 4, seed=1, workers=1)
        for batch in loader.all_batches(16):
            assert list(batch) == ["tokens", "label"]
            assert batch["tokens"].dtype == torch.int32 and batch["label"].dtype == torch.int64
            x, y = batch["tokens"], batch["label"]
            assert torch.equal(y, torch.where(x == PAD, -100, x.long()))
            assert {tuple(row) for row in x.tolist()} <= padded
            seen += len(x)
    assert seen == m.splits["train"].rows


def test_the_token_column_is_found_or_the_spec_refused(tmp_path):
    write_tokens(tmp_path / "raw", {"ids2": [[1, 2]] * ROWS, "title": ["a"] * ROWS})
    assert check_prepare(token_config(tmp_path)).spec.label == "tokens"
    second = {"tensors": {
        "tokens": {"dtype": "int32", "shape": [LENGTH], "pad_id": PAD, "truncate": True, "vocab_size": VOCAB},
        "ids2": {"dtype": "int32", "shape": [2], "vocab_size": VOCAB},
    }}
    with pytest.raises(ConfigError, match=r"several token columns \(tokens, ids2\): set pipelines.features.label"):
        check_prepare(token_config(tmp_path, **second))
    assert check_prepare(token_config(tmp_path, label="ids2", **second)).spec.label == "ids2"
    with pytest.raises(ConfigError, match="needs a token column: a 1-D integer tensor with a vocab_size"):
        check_prepare(token_config(tmp_path, tensors={"tokens": {"dtype": "int32", "shape": [LENGTH]}}))
    with pytest.raises(ValueError, match="label 'title' must name a column of pipelines.features.tensors"):
        token_config(tmp_path, label="title")
    synthetic = token_config(tmp_path).model_copy(update={"source": token_config(tmp_path).source.model_copy(
        update={"format": "synthetic"})})
    with pytest.raises(ConfigError, match="the synthetic source has none"):
        check_prepare(synthetic)


def test_the_next_token_loss_counts_only_the_targets_that_are_not_pads():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 5, generator=g)
    tokens = torch.randint(0, 5, (3, 6), generator=g)
    label = tokens.clone()
    label[0, 4:] = -100  # row 0 ends in two pads
    label[2, 1:] = -100  # row 2 is one token, then pads: it predicts nothing
    # By hand: position i's logits against token i+1, where token i+1 is no pad.
    terms = [-F.log_softmax(logits[b, i], -1)[label[b, i + 1]] for b in range(3) for i in range(5) if label[b, i + 1] >= 0]
    want = torch.stack(terms).mean()
    assert len(terms) == 3 + 5 + 0
    assert torch.allclose(next_token_loss(logits, label), want)
    assert torch.allclose(task_loss(logits, label), want)  # the task's default for [B, L] targets
    # Without the mask the pads (here: token 0) would count: another figure.
    assert not torch.allclose(F.cross_entropy(logits[:, :-1].reshape(-1, 5), tokens[:, 1:].reshape(-1)), want)
    # A batch of pads only: zero, not NaN.
    assert next_token_loss(logits, torch.full((3, 6), -100)).item() == 0.0
    # The epoch's figures count tokens: loss, perplexity = exp(loss), token accuracy.
    sums = batch_sums("next_token", logits, label, want)
    assert sums[2].item() == 8
    got = figures("next_token", "val", sums)
    assert got["val_loss"] == pytest.approx(want.item()) and got["val_perplexity"] == pytest.approx(math.exp(want.item()))
    correct = sum(int(logits[b, i].argmax() == label[b, i + 1]) for b in range(3) for i in range(5) if label[b, i + 1] >= 0)
    assert got["val_accuracy"] == pytest.approx(correct / 8)
    # What a score row holds: the row's own mean loss, its counted targets, and the id
    # predicted after its last non-pad position.
    rows = next_token_rows(logits, label)
    assert rows["tokens"].tolist() == [3, 5, 0]
    assert rows["loss"][0].item() == pytest.approx(torch.stack(terms[:3]).mean().item())
    assert math.isnan(rows["loss"][2].item())  # nothing to predict in row 2
    assert rows["next_token"].tolist() == [int(logits[0, 3].argmax()), int(logits[1, 5].argmax()),
                                           int(logits[2, 0].argmax())]


def test_the_decoder_is_causal_and_refuses_another_task():
    inputs = ModelInputs(task="next_token", num_classes=VOCAB, class_names=[], numeric=[], vectors={},
                         categorical=[], cardinalities=[], inputs={"ids": TensorInput(dtype="int32", shape=[LENGTH])},
                         label=TensorInput(dtype="int64", shape=[LENGTH]))
    model = decoder(inputs, hidden=[16, 16], heads=2)
    x = torch.randint(0, VOCAB, (2, LENGTH), dtype=torch.int32)
    out = model(ids=x)  # its input by the column's name, as the loader's named tensors give it
    assert out.shape == (2, LENGTH, VOCAB) and torch.equal(out, model(x))
    later = x.clone()
    later[:, 9] = (later[:, 9] + 1) % VOCAB
    changed = model(later)
    assert torch.equal(changed[:, :9], out[:, :9]) and not torch.allclose(changed[:, 9:], out[:, 9:])
    assert model.pipeline_layers() == ["embed", "block0", "block1", "head"]
    with pytest.raises(ConfigError, match="needs pipelines.features.task = 'next_token'"):
        decoder(inputs.model_copy(update={"task": "classification"}))


def test_fsdp_tensor_and_pipeline_train_the_decoder_as_single_process_does():
    # Every row has as many pads (a few, changing per step): each rank's and micro-batch's
    # mean loss then covers as many tokens as the global batch's, so the means agree.
    common = {"steps": 4, "batch": 8, "model": "decoder"}
    variants = [{"strategy": "fsdp"}, {"strategy": "tensor"}, {"strategy": "pipeline", "cfg": {"micro_batches": 2}}]
    ranks = launch_local(train_variants, {**common, "variants": variants}, world_size=2, timeout_s=300)
    reference = train_steps(0, 1, common)
    for i, variant in enumerate(variants):
        for rank, weights in enumerate(ranks):
            distance = relative_distance(weights[i], reference)
            assert distance <= TOLERANCE, (variant["strategy"], rank, distance)
    assert relative_distance(unsynchronised(common, 2), reference) > 3 * TOLERANCE


def test_a_job_trains_the_decoder_with_fsdp_registers_and_scores_it(lm, dask_client, tracking_uri, tmp_path):
    """fsdp training of the built-in decoder on the prepared token table (its default loss,
    perplexity logged), registration, batch scoring of the test split on Dask (per row: the
    next token after the sequence, its mean loss, its counted targets) and the registered
    model's predict on token arrays."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from .serving_helpers import score
    from shardline.training.config import TrackingConfig, TrainingConfig
    from shardline.training.job import run_training
    from shardline.training.models.factory import build_model

    from .serving_helpers import read_scores

    data = lm["dirs"]["dask"]
    cfg = TrainingConfig(launcher="local", world_size=2, strategy="fsdp", batch_size=8, epochs=1, model="decoder",
                         hidden=[16, 16], heads=2, checkpoint_dir=str(tmp_path / "ckpt"), timeout_s=120)
    tracking = TrackingConfig(tracking_uri=tracking_uri, experiment="lm", registered_model="lm")
    result = run_training(cfg, tracking, data, LocalEngine())
    logged = MlflowClient(tracking_uri).get_run(result.run_id).data.metrics
    assert {"train_loss", "train_perplexity", "val_loss", "val_perplexity", "val_accuracy"} <= logged.keys(), logged
    assert logged["val_perplexity"] == pytest.approx(math.exp(logged["val_loss"]), rel=1e-6)
    model = build_model(load_manifest(data), cfg)
    model.load_state_dict(result.weights)
    model.eval()

    out = tmp_path / "scores"
    scored = score("dask", dask_client, result.model_uri, tracking_uri, data, str(out))
    assert scored.rows == load_manifest(data).splits["test"].rows > 0
    table = read_scores(out).sort_by("id")  # the input's key column, by its own name (#53.19)
    assert table.column_names == ["id", "prediction", "loss", "tokens", "model_name", "model_version", "scored_at"]
    # What the model gives on the rows' own sequences, rebuilt from the raw generator by key.
    keys = table.column("id").to_pylist()
    x = torch.tensor([(sequences()[k] + [PAD] * LENGTH)[:LENGTH] for k in keys], dtype=torch.int32)
    want = next_token_rows(model(tokens=x), torch.where(x == PAD, -100, x.long()))
    assert table.column("tokens").to_pylist() == want["tokens"].tolist()
    assert table.column("prediction").to_pylist() == want["next_token"].tolist()
    np.testing.assert_allclose(table.column("loss").to_numpy(), want["loss"].numpy(), rtol=1e-5)

    pyfunc = mlflow.pyfunc.load_model(result.model_uri)
    predicted = pyfunc.predict({"tokens": x[:3].numpy()})
    assert predicted["prediction"].tolist() == want["next_token"][:3].tolist()
    np.testing.assert_allclose(predicted["loss"].to_numpy(), want["loss"][:3].numpy(), rtol=1e-5)
