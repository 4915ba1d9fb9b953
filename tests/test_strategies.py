"""Numerical truth: each strategy matches single-process training of the same model and data."""

from __future__ import annotations

import pytest
import torch

from shardline.foundation.errors import ConfigError
from shardline.training.config import TrainingConfig
from shardline.engines.local.launch import launch_local
from shardline.engines.spark.launch import launch_spark_barrier
from shardline.training.strategies import strategy_for

from .dist_helpers import train_steps

ARGS = {"strategy": "ddp", "steps": 8, "batch": 64}


def _single_process() -> dict:
    return train_steps(0, 1, ARGS)


def _assert_close(a: dict, b: dict, atol: float = 1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


def test_ddp_two_local_processes_match_single_process():
    ranks = launch_local(train_steps, ARGS, world_size=2, timeout_s=120)
    reference = _single_process()
    _assert_close(ranks[0], reference)
    _assert_close(ranks[1], reference)
    # The check has teeth: training moved the weights away from their initial values.
    torch.manual_seed(0)
    moved = train_steps(0, 1, {**ARGS, "steps": 0})
    assert any(not torch.allclose(moved[k], reference[k]) for k in reference)


def test_ddp_on_spark_barrier_stage_matches_single_process(spark):
    ranks = launch_spark_barrier(spark, train_steps, ARGS, world_size=2, timeout_s=120)
    _assert_close(ranks[0], _single_process())


def test_ddp_on_dask_workers_matches_single_process(dask_client):
    from shardline.engines.dask.launch import launch_dask

    ranks = launch_dask(dask_client, train_steps, ARGS, world_size=2, timeout_s=120)
    _assert_close(ranks[0], _single_process())
    _assert_close(ranks[1], _single_process())


@pytest.mark.parametrize(
    "variant, atol",
    [
        ({"model": "transformer"}, 1e-5),
        ({"model": "cnn"}, 1e-5),
        ({"cfg": {"activation_checkpointing": True}}, 1e-5),
        ({"model": "transformer", "cfg": {"activation_checkpointing": True}}, 1e-5),
        # bf16 forward and fp16 gradients round differently on a half and a whole batch
        # (an unsynchronised rank would be 2.4e-2 off: tests/test_equivalence.py).
        ({"cfg": {"precision": "bf16"}}, 2e-3),
        ({"cfg": {"ddp": {"grad_compression": "fp16"}}}, 2e-3),
    ],
)
def test_ddp_switches_and_models_match_single_process(variant, atol):
    args = {**ARGS, **variant}
    ranks = launch_local(train_steps, args, world_size=2, timeout_s=120)
    reference = train_steps(0, 1, args)
    _assert_close(ranks[0], reference, atol=atol)
    # The rounding switches really act: their results are not bit-equal to fp32.
    exact = train_steps(0, 1, {**args, "cfg": {}})
    differs = lambda a: any(not torch.equal(a[k], exact[k]) for k in exact)  # noqa: E731
    cfg = variant.get("cfg", {})
    if cfg.get("precision") == "bf16":
        assert differs(reference)
    if cfg.get("ddp", {}).get("grad_compression") == "fp16":
        assert differs(ranks[0])


def test_unknown_strategy_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown strategy 'nope' \(valid: ddp, fsdp, pipeline, ps, tensor\)"):
        strategy_for(TrainingConfig(strategy="nope"))
