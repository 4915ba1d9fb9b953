"""Tensor parallel: matches single-process training, and each rank really holds only its shard."""

from __future__ import annotations

import pytest
import torch

from shardline.foundation.errors import ConfigError
from shardline.training.config import TrainingConfig
from shardline.engines.local.launch import launch_local
from shardline.training.strategies import strategy_for

from .dist_helpers import MODELS, resumed, train_steps

ARGS = {"strategy": "tensor", "steps": 4, "batch": 32}


def _assert_close(a: dict, b: dict, atol: float = 1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


def test_mlp_tensor_parallel_matches_single_process():
    # The transformer, dp x tp, AdamW and bf16: tests/test_equivalence.py.
    args = {**ARGS, "model": "mlp", "cfg": {"tp": 2}}
    ranks = launch_local(train_steps, args, world_size=2, timeout_s=120)
    reference = train_steps(0, 1, args)
    for r in ranks:  # every rank gathers the whole plain model
        _assert_close(r, reference)
    initial = train_steps(0, 1, {**args, "steps": 0})
    assert any(not torch.allclose(initial[k], reference[k]) for k in reference)


def shard_shapes(rank: int, world_size: int, model_name: str) -> dict:
    """This rank's own (local) weights right after setup, and their kinds."""
    from torch.distributed.tensor import DTensor

    cfg = TrainingConfig(world_size=world_size, strategy="tensor", mesh={"tp": world_size}, batch_size=8)
    torch.manual_seed(0)
    parallel = strategy_for(cfg).setup(
        MODELS[model_name](), cfg, rank, world_size, torch.device("cpu"),
        lambda p: torch.optim.SGD(p, lr=0.1),
    )
    state = parallel.model.state_dict()
    return {
        "weights": {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state.items()},
        "dtensor": sorted(k for k, v in state.items() if isinstance(v, DTensor)),
    }


def test_transformer_rank_holds_only_its_heads():
    ranks = launch_local(shard_shapes, "transformer", world_size=2, timeout_s=120)
    torch.manual_seed(0)
    full = MODELS["transformer"]().state_dict()  # d_model 16, heads 4 (head_dim 4)
    for r, got in enumerate(ranks):
        mine = got["weights"]
        assert mine.keys() == full.keys()
        # q, k, v: the rows of this rank's 2 heads (8 of 16) each; out: the matching columns.
        for proj in ("q", "k", "v"):
            assert torch.equal(mine[f"1.attn.{proj}.weight"], full[f"1.attn.{proj}.weight"][r * 8: r * 8 + 8])
        assert torch.equal(mine["1.attn.q.bias"], full["1.attn.q.bias"][r * 8: r * 8 + 8])
        assert torch.equal(mine["1.attn.out.weight"], full["1.attn.out.weight"][:, r * 8: r * 8 + 8])
        assert torch.equal(mine["1.ff1.weight"], full["1.ff1.weight"][r * 16: r * 16 + 16])
        assert torch.equal(mine["1.ff2.weight"], full["1.ff2.weight"][:, r * 16: r * 16 + 16])
        # The rowwise bias is replicated (a DTensor, whole); norms and the head are plain.
        assert torch.equal(mine["1.ff2.bias"], full["1.ff2.bias"])
        assert torch.equal(mine["1.norm1.weight"], full["1.norm1.weight"])
        assert "1.attn.q.weight" in got["dtensor"] and "1.norm1.weight" not in got["dtensor"]


def test_mlp_rank_holds_one_pair_split_and_the_head_whole():
    ranks = launch_local(shard_shapes, "mlp", world_size=2, timeout_s=120)
    torch.manual_seed(0)
    full = MODELS["mlp"]().state_dict()  # Dense 8 -> 16, Dense 16 -> 8, head 8 -> 3
    for r, got in enumerate(ranks):
        mine = got["weights"]
        assert torch.equal(mine["1.linear.weight"], full["1.linear.weight"][r * 8: r * 8 + 8])
        assert torch.equal(mine["1.linear.bias"], full["1.linear.bias"][r * 8: r * 8 + 8])
        assert torch.equal(mine["2.linear.weight"], full["2.linear.weight"][:, r * 8: r * 8 + 8])
        assert torch.equal(mine["3.weight"], full["3.weight"])


def test_resume_from_sharded_checkpoint_continues_exactly(tmp_path):
    for got in launch_local(resumed, {"strategy": "tensor", "directory": str(tmp_path / "ckpt")}, world_size=2, timeout_s=120):
        for k, v in got["straight"].items():
            assert torch.equal(got["resumed"][k], v), k


def _check(model: str, **settings):
    cfg = TrainingConfig(strategy="tensor", model=model, **settings)
    strategy_for(cfg).check(cfg, MODELS[model]())


@pytest.mark.parametrize(
    "model, settings, message",
    [
        ("transformer", {"world_size": 3, "mesh": {"tp": 3}, "batch_size": 9},
         r"^training.mesh.tp 3 must divide training.heads 4 \(and d_model 16\)$"),
        ("mlp", {"world_size": 3, "mesh": {"tp": 3}, "batch_size": 9},
         r"^training.mesh.tp 3 must divide training.hidden\[0\] 16$"),
        ("mlp", {"world_size": 4, "mesh": {"dp_replicate": 3, "tp": 2}},
         r"^training.mesh dp_replicate 3 x tp 2 = 6 must equal training.world_size 4$"),
        ("mlp", {"world_size": 4, "mesh": {"tp": 2}, "batch_size": 9},
         r"^training.batch_size 9 must be a multiple of the 2 data-parallel ranks \(training.mesh dp_replicate 2 x tp 2\)$"),
        ("cnn", {"world_size": 2},
         r"^training.mesh.tp 2: training.model cnn declares no tensor-parallel plan"),
        ("mlp", {"world_size": 2, "tensor": {"plan": {"1.linear": "colwise", "9.linear": "rowwise"}}},
         r"^training.tensor.plan: module '9.linear' is not in training.model mlp \(its Linear layers: "
         r"1.linear, 2.linear, 3\)$"),
        ("mlp", {"world_size": 2, "tensor": {"plan": {"1.linear": "colwise", "0": "rowwise"}}},
         r"^training.tensor.plan: '0' is a FeatureInput, not a Linear"),
        ("mlp", {"world_size": 2, "tensor": {"plan": {"2.linear": "rowwise"}}},
         r"^training.tensor.plan: rowwise '2.linear' follows no colwise layer"),
        ("mlp", {"world_size": 2, "tensor": {"plan": {"3": "colwise"}}},
         r"^training.tensor.plan: colwise '3' is closed by no rowwise layer"),
        ("mlp", {"world_size": 2, "tensor": {"plan": {"1.linear": "colwise", "3": "rowwise"}}},
         r"^training.tensor.plan: '2.linear' lies between colwise '1.linear' and its rowwise layer"),
        ("transformer", {"world_size": 2, "tensor": {"plan": {"1.attn.q": "colwise", "1.attn.out": "rowwise"}}},
         r"^training.tensor.plan: attention '1.attn' splits q, k and v colwise and out rowwise, or none"),
        ("mlp", {"world_size": 3, "batch_size": 9, "tensor": {"plan": {"2.linear": "colwise", "3": "rowwise"}}},
         r"^training.mesh.tp 3 must divide training.hidden\[1\] 8$"),
    ],
)
def test_check_refuses_with_one_line(model, settings, message):
    with pytest.raises(ConfigError, match=message):
        _check(model, **settings)


def test_check_accepts_a_dividing_tp():
    _check("transformer", world_size=4, mesh={"tp": 4}, batch_size=8)


def test_an_mlp_with_one_hidden_layer_has_nothing_to_split():
    from shardline.training.models.builtin import TabularMLP

    cfg = TrainingConfig(strategy="tensor", world_size=2, hidden=[16])
    with pytest.raises(ConfigError, match=r"^training.mesh.tp 2: training.hidden \[16\] has no pair"):
        strategy_for(cfg).check(cfg, TabularMLP(5, [4], [16], 3, embedding_dim=3))
