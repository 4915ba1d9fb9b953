"""Pipeline parallel: the schedules' dry-run, the checks, and equivalence with single-process training."""

from __future__ import annotations

from itertools import combinations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.errors import ConfigError
from training.config import TrainingConfig
from training.launchers.local import launch_local
from training.strategies.pipeline import Pipeline, balanced_bounds
from training.strategies.schedule import (
    DeadlockError, actions, bubble_formula, dry_run, grid, run_actions,
)

from .dist_helpers import MODELS, global_batches, train_steps

ARGS = {"strategy": "pipeline", "steps": 4, "batch": 32}


def _assert_close(a: dict, b: dict, atol: float = 1e-5):
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


# --- schedules (no processes) ---

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dry_run_runs_every_action_once_with_the_formula_bubble(schedule):
    for p in range(1, 6):
        for m in range(1, 9):
            timeline = dry_run(schedule, p, m)
            for s, row in enumerate(timeline):
                assert [a for a in row if a] == actions(schedule, p, m, s)
                # Unit-time actions: each stage idles (p-1)/(m+p-1) of the run.
                assert row.count(None) / len(row) == pytest.approx(bubble_formula(p, m))
                held = in_flight = 0
                for a in row:
                    in_flight += {None: 0, "F": 1, "B": -1}[a and a[0]]
                    held = max(held, in_flight)
                # 1F1B bounds the activations a stage holds; GPipe holds all m.
                assert held == (min(p - s, m) if schedule == "1f1b" else m)


def test_grid_shows_each_stage_per_time_step():
    assert grid(dry_run("gpipe", 2, 2)) == (
        "step    0  1  2  3  4  5\n"
        "stage 0 F0 F1 .  .  B0 B1\n"
        "stage 1 .  F0 F1 B0 B1 ."
    )


def test_dry_run_catches_a_schedule_that_waits_forever():
    # Stage 1 runs its forwards first while stage 0 waits for a gradient before sending F1.
    broken = [
        [("F", 0), ("B", 0), ("F", 1), ("B", 1)],
        [("F", 0), ("F", 1), ("B", 0), ("B", 1)],
    ]
    with pytest.raises(DeadlockError, match=(
        r"stage 0 waits forever at B0 for the gradient of micro-batch 0 from stage 1; "
        r"stage 1 waits forever at F1 for the activation of micro-batch 1 from stage 0"
    )):
        run_actions(broken)
    # Swapping stage 1's middle actions back makes the same lists run.
    run_actions([broken[0], [("F", 0), ("B", 0), ("F", 1), ("B", 1)]])
    with pytest.raises(ValueError, match="stage 1's actions must hold F0..F1 and B0..B1"):
        run_actions([broken[0], [("F", 0), ("B", 1), ("F", 1), ("B", 0)]])


def test_balanced_bounds_minimise_the_largest_stage():
    g = torch.Generator().manual_seed(0)
    for n in range(1, 8):
        sizes = torch.randint(0, 100, (n,), generator=g).tolist()
        for p in range(1, n + 1):
            bounds = balanced_bounds(sizes, p)
            largest = lambda b: max(sum(sizes[lo:hi]) for lo, hi in zip(b, b[1:]))  # noqa: E731
            every = [[0, *cuts, n] for cuts in combinations(range(1, n), p - 1)]
            assert bounds in every
            assert largest(bounds) == min(largest(b) for b in every)


def test_describe_shows_stages_grid_and_bubble():
    model = MODELS["mlp"]()
    cfg = TrainingConfig(world_size=2, strategy="pipeline", batch_size=32, micro_batches=4)
    text = Pipeline().describe(cfg, model)
    stage_lines = [line for line in text.splitlines() if ": layers" in line]
    counts = [int(line.rsplit(", ", 1)[1].split()[0].replace(",", "")) for line in stage_lines]
    assert len(counts) == 2 and sum(counts) == sum(p.numel() for p in model.parameters())
    assert grid(dry_run("1f1b", 2, 4)).splitlines()[1] in text
    assert "bubble (p-1)/(m+p-1) = 1/5 = 20.0%" in text


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"world_size": 5}, r"training.pp 5: more pipeline stages than the model's 4 layers"),
        ({"world_size": 4, "dp": 3}, r"training.dp 3 x training.pp"),
        ({"world_size": 2, "tp": 2}, r"training.tp = 2"),
        ({"pipeline_boundaries": [1, 2]}, r"pipeline_boundaries \[1, 2\]: 2 pipeline stages need 1"),
        ({"world_size": 3, "pipeline_boundaries": [2, 2]}, r"pipeline_boundaries \[2, 2\] must be increasing"),
        ({"pipeline_boundaries": [4]}, r"pipeline_boundaries \[4\] must be increasing .* from 1 to 3"),
        ({"pipeline_boundaries": [0]}, r"pipeline_boundaries \[0\] must be increasing"),
        ({"world_size": 4, "pp": 2, "batch_size": 31}, r"batch_size 31 must be a multiple of training.dp 2"),
        ({"batch_size": 30}, r"training.micro_batches 4 must divide each pipeline's batch of 30 rows"),
    ],
)
def test_check_names_the_bad_setting(settings, message):
    cfg = TrainingConfig(**{"world_size": 2, "strategy": "pipeline", "batch_size": 32, **settings})
    with pytest.raises(ConfigError, match=message):
        Pipeline().check(cfg, MODELS["mlp"]())


# --- training on real process groups ---

def test_gpipe_and_1f1b_match_single_process_and_each_other():
    reference = train_steps(0, 1, ARGS)
    results = {}
    for schedule in ("gpipe", "1f1b"):
        args = {**ARGS, "cfg": {"pipeline_schedule": schedule, "micro_batches": 4}}
        results[schedule] = launch_local(train_steps, args, world_size=2, timeout_s=120)
        for rank_result in results[schedule]:
            _assert_close(rank_result, reference)
    # Same backward order, so the same sums: the schedule changes only the timing.
    for k in reference:
        assert torch.equal(results["gpipe"][0][k], results["1f1b"][0][k]), k
    # The check has teeth: training moved the weights.
    initial = train_steps(0, 1, {**ARGS, "steps": 0})
    assert any(not torch.allclose(initial[k], reference[k]) for k in reference)


@pytest.mark.parametrize(
    "variant, world_size, atol",
    [
        ({"model": "transformer"}, 2, 1e-5),
        ({"cfg": {"dp": 2, "pp": 2, "micro_batches": 2}}, 4, 1e-5),
        ({"cfg": {"micro_batches": 1}}, 2, 1e-5),
        # Activations cross stages as float32, but bf16 rounds the forward differently per micro-batch.
        ({"cfg": {"precision": "bf16"}}, 2, 2e-2),
    ],
)
def test_pipeline_variants_match_single_process(variant, world_size, atol):
    args = {**ARGS, **variant}
    ranks = launch_local(train_steps, args, world_size=world_size, timeout_s=120)
    reference = train_steps(0, 1, args)
    for rank_result in ranks:
        _assert_close(rank_result, reference, atol=atol)


def stage_report(rank: int, world_size: int, args: dict) -> dict:
    """Train as train_steps does, then report what this rank holds and returned."""
    cfg = TrainingConfig(world_size=world_size, strategy="pipeline", batch_size=args["batch"], **args["cfg"])
    torch.manual_seed(0)
    model = MODELS[args["model"]]()
    Pipeline().check(cfg, model)
    parallel = Pipeline().setup(
        model, cfg, rank, world_size, torch.device("cpu"), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    losses = []
    for x, y in global_batches(args["steps"], args["batch"]):
        out = parallel.step(x, y)  # dp 1: every rank reads the whole batch
        if out is not None:
            logits, loss = out
            assert logits.shape == (args["batch"], 3)
            losses.append((loss.item(), F.cross_entropy(logits, y).item()))
    # Every parameter this rank's Parallel can reach, named as in the plain model.
    held = {
        name: p.numel() for v in vars(parallel).values() if isinstance(v, nn.Module)
        for name, p in v.named_parameters()
    }
    optimized = sum(p.numel() for g in parallel.optimizer.param_groups for p in g["params"]) \
        if parallel.optimizer else 0
    return {
        "held": held, "optimized": optimized, "losses": losses, "reports": parallel.reports,
        "metrics": parallel.epoch_metrics(), "full": parallel.full_state_dict(),
    }


def test_boundaries_from_config_decide_what_each_stage_holds():
    # cnn layers: 0 FeatureInput, 1 Channels (no parameters), 2-3 ConvBlock, 4 PoolHead.
    args = {"model": "cnn", "steps": 3, "batch": 32, "cfg": {"pp": 3, "pipeline_boundaries": [1, 2]}}
    ranks = launch_local(stage_report, args, world_size=3, timeout_s=120)
    layers_of = lambda r: {name.split(".")[0] for name in ranks[r]["held"]}  # noqa: E731
    assert layers_of(0) == {"0"}
    assert layers_of(1) == set() and ranks[1]["optimized"] == 0
    assert layers_of(2) == {"2", "3", "4"}
    for r in ranks:
        assert r["optimized"] == sum(r["held"].values())
    assert [r["reports"] for r in ranks] == [False, False, True]
    # Only the last stage returns (logits, loss); the loss is the batch's mean loss.
    assert ranks[0]["losses"] == ranks[1]["losses"] == []
    assert len(ranks[2]["losses"]) == 3
    for loss, recomputed in ranks[2]["losses"]:
        assert loss == pytest.approx(recomputed, rel=1e-5)
    reference = train_steps(0, 1, {**args, "cfg": {}})
    for r in ranks:
        assert r["metrics"]["pipeline_bubble_formula"] == pytest.approx(2 / 6)
        assert 0 < r["metrics"]["pipeline_bubble"] < 1
        _assert_close(r["full"], reference)
