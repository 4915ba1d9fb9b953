"""Parameter server: sync is single-process training on the global batch; servers hold
only their shard; async keeps its staleness bound and still learns."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardline.foundation.errors import ConfigError
from shardline.engines.local.launch import launch_local
from shardline.training.strategies import strategy_for
from shardline.training.strategies.ps import shard_names

from .dist_helpers import MODELS, global_batches, train_steps, training_config

ARGS = {"strategy": "ps", "steps": 8, "batch": 64}


def _assert_close(a: dict, b: dict, atol: float = 1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


def _setup(rank: int, world_size: int, settings: dict, momentum: float = 0.0):
    cfg = training_config(world_size=world_size, strategy="ps", batch_size=64, **settings)
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    strategy = strategy_for(cfg)
    strategy.check(cfg, model)
    return strategy.setup(
        model, cfg, rank, world_size, torch.device("cpu"),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=momentum),
    )


def _step(parallel, x, y) -> None:
    if parallel.data_rank is None:
        parallel.step(None, None)
        return
    local = len(y) // parallel.data_world
    part = slice(parallel.data_rank * local, (parallel.data_rank + 1) * local)
    parallel.step(x[part], y[part])


def _train(parallel, batches) -> None:
    for x, y in batches:
        _step(parallel, x, y)


def _cloned(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.parametrize("servers, world", [(1, 3), (2, 4)])
def test_sync_matches_single_process(servers, world):
    args = {**ARGS, "cfg": {"servers": servers}}
    ranks = launch_local(train_steps, args, world_size=world, timeout_s=120)
    reference = train_steps(0, 1, args)
    for weights in ranks:  # servers and workers alike get the servers' values
        _assert_close(weights, reference)
    initial = train_steps(0, 1, {**args, "steps": 0})
    assert any(not torch.allclose(initial[k], reference[k]) for k in reference)


def shares_and_resume(rank: int, world_size: int, args: dict) -> dict:
    """Each rank's share, and 4 sync steps straight vs 2, checkpoint, resume, 2."""
    settings, batches = {"servers": 2}, list(global_batches(4, 64))
    straight = _setup(rank, world_size, settings, momentum=0.9)
    _train(straight, batches)
    straight_weights = _cloned(straight.full_state_dict())

    first = _setup(rank, world_size, settings, momentum=0.9)
    _train(first, batches[:2])
    first.save_checkpoint(args["directory"])  # the servers their shards, through DCP
    resumed = _setup(rank, world_size, settings, momentum=0.9)
    resumed.load_checkpoint(args["directory"])
    _train(resumed, batches[2:])

    shard = getattr(first, "shard", None)
    return {
        "data_rank": first.data_rank, "data_world": first.data_world, "reports": first.reports,
        "shard": {n: tuple(p.shape) for n, p in shard.items()} if shard is not None else None,
        "optimizer": [
            tuple(p.shape) for g in first.optimizer.param_groups for p in g["params"]
        ] if first.optimizer is not None else None,
        # A module holding parameters beyond the rank's shard: the whole model (a worker's replica).
        "holds_a_model": any(isinstance(v, nn.Module) and {n for n, _ in v.named_parameters()} - set(shard or {})
                             for v in vars(first).values()),
        "straight": straight_weights, "resumed": _cloned(resumed.full_state_dict()),
    }


def test_servers_hold_only_their_shard_and_resume_exactly(tmp_path):
    ranks = launch_local(shares_and_resume, {"directory": str(tmp_path / "ckpt")}, world_size=4, timeout_s=120)
    workers, servers = ranks[:2], ranks[2:]
    for r, w in enumerate(workers):
        assert (w["data_rank"], w["data_world"], w["reports"]) == (r, 2, True)
        assert w["optimizer"] is None and w["shard"] is None and w["holds_a_model"]

    torch.manual_seed(0)
    model = MODELS["mlp"]()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    expected = shard_names(model, 2)
    for s, srv in enumerate(servers):
        assert (srv["data_rank"], srv["reports"]) == (None, False)
        assert list(srv["shard"]) == expected[s] and not srv["holds_a_model"]
        assert srv["shard"] == {n: shapes[n] for n in expected[s]}
        assert srv["optimizer"] == list(srv["shard"].values())  # it steps its shard only
    # The two shards split the model: disjoint, complete, each a real part, balanced.
    a, b = servers[0]["shard"], servers[1]["shard"]
    assert a and b and not a.keys() & b.keys() and a.keys() | b.keys() == shapes.keys()
    numel = lambda sh: sum(torch.Size(v).numel() for v in sh.values())  # noqa: E731
    assert abs(numel(a) - numel(b)) <= max(torch.Size(v).numel() for v in shapes.values())

    # Resuming from a checkpoint (momentum in the servers' optimizers) changes nothing.
    for r in ranks:
        _assert_close(r["resumed"], r["straight"], atol=1e-6)
        _assert_close(r["straight"], ranks[0]["straight"], atol=0)


def async_run(rank: int, world_size: int, args: dict) -> dict:
    """8 async steps; the last worker starts only once worker 0 has finished k steps
    (a file says so), which the bound must allow without it."""
    k = args["settings"]["staleness"]
    parallel = _setup(rank, world_size, args["settings"])
    ahead = Path(args["dir"]) / "worker0_ran_ahead"
    waited_for_worker0 = None
    if parallel.data_rank == parallel.data_world - 1:
        deadline = time.monotonic() + 60
        while not ahead.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        waited_for_worker0 = ahead.exists()
    for i, (x, y) in enumerate(global_batches(8, 64)):
        if rank == 0 and i == k:
            ahead.touch()
        _step(parallel, x, y)
    return {
        "metrics": parallel.epoch_metrics(), "weights": _cloned(parallel.full_state_dict()),
        "waited_for_worker0": waited_for_worker0,
    }


@pytest.mark.parametrize("servers, k", [(1, 0), (2, 2)])
def test_async_staleness_stays_within_its_bound(servers, k, tmp_path):
    workers = 2
    settings = {"servers": servers, "mode": "async", "staleness": k}
    args = {"settings": settings, "dir": str(tmp_path)}
    ranks = launch_local(async_run, args, world_size=workers + servers, timeout_s=120)
    # Worker 0 ran k steps ahead of a worker that had not pushed once.
    assert ranks[workers - 1]["waited_for_worker0"]
    for r in ranks[:workers]:
        assert r["metrics"].keys() == {"ps_push_ms", "ps_pull_ms"}
        assert r["metrics"]["ps_pull_ms"] > 0
    # Bound (ServerRank._release): at most (W-1)(2k+1) other pushes between the values a
    # gradient was computed on and its apply.
    bound = (workers - 1) * (2 * k + 1)
    for r in ranks[workers:]:
        stale = r["metrics"]
        assert stale["ps_staleness_max"] <= bound
        # The late worker's first gradient, on the initial values, follows k of worker 0's.
        assert stale["ps_staleness_max"] >= max(k, 1)
        if k == 0:
            # Lockstep: each round every worker computes on the same values, applied
            # one after the other: staleness 0, 1, ..., W-1.
            assert stale["ps_staleness_mean"] == pytest.approx((workers - 1) / 2)
    # Every rank gets the servers' values, and training moved them.
    for r in ranks:
        _assert_close(r["weights"], ranks[0]["weights"], atol=0)
    initial = train_steps(0, 1, {**ARGS, "steps": 0})
    assert any(not torch.allclose(initial[n], ranks[0]["weights"][n]) for n in initial)


def async_late_receive(rank: int, world_size: int, args: dict) -> str:
    """4 async steps and nothing after (no collective that would settle the servers' sends),
    as a benchmark's or a user's loop ends; the last worker asks for its last reply 2 s late."""
    from shardline.training.strategies import ps

    parallel = _setup(rank, world_size, {"servers": 1, "mode": "async", "staleness": 1})
    batches = list(global_batches(4, 64))
    if parallel.data_rank == parallel.data_world - 1:
        recv, calls = ps.collectives.recv, []

        def late_recv(*a, **kw):
            calls.append(1)
            if len(calls) == len(batches):
                time.sleep(2.0)
            return recv(*a, **kw)

        ps.collectives.recv = late_recv
    _train(parallel, batches)
    parallel.close()
    return type(parallel).__name__


def test_async_server_leaves_only_once_its_last_replies_are_received():
    # Before Parallel.close a server dropped its last sends on its way out: the late worker
    # then waited in its receive, the server in the group's closing barrier, for the timeout.
    ranks = launch_local(async_late_receive, {}, world_size=3, timeout_s=30)
    assert ranks == ["WorkerRank", "WorkerRank", "ServerRank"]


def _learnable(steps: int, batch: int, seed: int):
    """Labels from a fixed linear rule on the numerics: a task a model can learn."""
    rule = torch.randn(5, 3, generator=torch.Generator().manual_seed(7))
    for x, _ in global_batches(steps, batch, seed=seed):
        yield x, (x[:, :5] @ rule).argmax(1)


def async_learns(rank: int, world_size: int, args: dict) -> dict:
    parallel = _setup(rank, world_size, {"servers": 1, "mode": "async", "staleness": 1})
    _train(parallel, _learnable(80, 64, seed=3))
    return _cloned(parallel.full_state_dict())


def test_async_training_lowers_the_loss():
    weights = launch_local(async_learns, {}, world_size=3, timeout_s=120)[0]
    x, y = next(_learnable(1, 512, seed=11))  # held-out rows
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    with torch.no_grad():
        before = F.cross_entropy(model(x), y).item()
        model.load_state_dict(weights)
        after = F.cross_entropy(model(x), y).item()
    assert after < 0.5 * before, (before, after)


@pytest.mark.parametrize(
    "settings, model, message",
    [
        ({"world_size": 2, "servers": 2}, None,
         r"^training.ps.servers 2 leaves no worker rank \(training.world_size 2\)$"),
        ({"world_size": 3, "batch_size": 63}, None,
         r"^training.batch_size 63 must be a multiple of the 2 ps workers"),
        ({"world_size": 3, "tp": 2}, None, r"^training.mesh.tp = 2: strategy 'ps' has no device mesh"),
        ({"world_size": 3, "dp_replicate": 3}, None, r"^training.mesh.dp_replicate = 3: strategy 'ps' has no device mesh"),
        ({"world_size": 4, "servers": 2}, nn.Linear(5, 3, bias=False),
         r"^training.ps.servers 2 exceeds the model's 1 parameter tensors"),
        ({"world_size": 3}, nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3)),
         r"^training.strategy ps: model 'mlp' has buffers"),
    ],
)
def test_check_refuses_bad_settings_in_one_line(settings, model, message):
    with pytest.raises(ConfigError, match=message) as err:
        cfg = training_config(**{"strategy": "ps", "batch_size": 64, **settings})
        strategy_for(cfg).check(cfg, model if model is not None else MODELS["mlp"]())
    assert "\n" not in str(err.value)
