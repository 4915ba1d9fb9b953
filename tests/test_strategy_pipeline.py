"""Pipeline parallel on torch.distributed.pipelining: the schedules' layouts and replay,
the checks, equivalence with single-process training, and what the executor measures."""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardline.foundation.errors import ConfigError
from shardline.training.config import TrainingConfig
from shardline.engines.local.launch import launch_local
from shardline.training.models.builtin import TabularMLP
from shardline.training.strategies import strategy_for
from shardline.training.strategies.base import train_step
from shardline.training.strategies.pipeline_stages import balanced_bounds, pipeline_layout
from shardline.training.strategies.precision import Precision
from shardline.training.strategies.schedule import (
    SCHEDULES, Layout, ReplayStuck, closed_form, grid, in_flight, layout, replay, schedule_bubble,
    unit_timeline,
)

from .dist_helpers import MODELS, global_batches, train_steps, training_config

ARGS = {"strategy": "pipeline", "steps": 4, "batch": 32}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}
# bf16 rounds each micro-batch's forward differently from the whole batch's.
ATOL = {"fp32": 1e-5, "bf16": 2e-2}


def _assert_close(a: dict, b: dict, atol: float = 1e-5):
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


def _layouts():
    """Every schedule on 2-4 ranks, 1-8 micro-batches, 1-3 stages per rank, as torch takes them."""
    for name, spec in SCHEDULES.items():
        for p in range(2, 5):
            for v in [spec.stages_per_rank] if spec.stages_per_rank else [2, 3]:
                for m in range(1, 9):
                    try:
                        yield layout(name, p, v, m)
                    except ValueError:
                        continue


# --- schedules (no processes) ---

def test_layouts_run_every_action_of_every_stage_once_in_dependency_order():
    for lay in _layouts():
        assert sorted(lay.stage_rank) == list(range(lay.stages))
        for r, order in enumerate(lay.orders):
            stages = lay.rank_stages(r)
            assert len(stages) == lay.stages_per_rank
            split = any(kind == "I" for _, kind, _ in order)
            kinds = ("F", "I", "W") if split else ("F", "B")
            assert sorted(order) == sorted((s, k, i) for s in stages for k in kinds for i in range(lay.micro_batches))
            for s in stages:
                for i in range(lay.micro_batches):
                    at = [order.index((s, k, i)) for k in kinds]
                    assert at == sorted(at), (lay.name, s, i)
        # The replay runs every action after its input, one at a time on each rank.
        for r, timeline in enumerate(unit_timeline(lay)):
            assert [a for _, _, a in timeline] == lay.orders[r]
            assert all(e0 <= s1 for (_, e0, _), (s1, _, _) in zip(timeline, timeline[1:]))


def test_placements_are_the_schedules_own():
    assert layout("1f1b", 3, 1, 4).stage_rank == {0: 0, 1: 1, 2: 2}
    assert layout("interleaved-1f1b", 3, 2, 6).stage_rank == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}
    assert layout("zbv", 3, 2, 6).stage_rank == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}


def test_schedule_bubble_is_the_textbook_formula_and_zbv_beats_them():
    for lay in _layouts():
        formula = closed_form(lay)
        if formula:
            _, num, den = formula
            assert Fraction(schedule_bubble(lay)).limit_denominator(1000) == Fraction(num, den), lay
    # Interleaving shrinks the bubble v-fold (in micro-batches); ZBV's W fills nearly all of it.
    p, m = 4, 8
    assert schedule_bubble(layout("interleaved-1f1b", p, 2, m)) == pytest.approx(3 / 19)
    assert schedule_bubble(layout("zbv", p, 2, m)) < schedule_bubble(layout("interleaved-1f1b", p, 2, m)) / 2


def test_1f1b_holds_at_most_p_minus_s_micro_batches_gpipe_all():
    for p in range(2, 6):
        for m in range(p, 10):
            assert in_flight(layout("1f1b", p, 1, m)) == {s: p - s for s in range(p)}
            assert in_flight(layout("gpipe", p, 1, m)) == {s: m for s in range(p)}


def test_grid_shows_each_rank_per_time_unit():
    assert grid(layout("gpipe", 2, 1, 2)) == (
        "time   0   1   2   3   4   5   6   7   8\n"
        "rank 0 0F0 0F1 .   .   .   0B0 0B0 0B1 0B1\n"
        "rank 1 .   1F0 1F1 1B0 1B0 1B1 1B1 .   ."
    )


def test_replay_times_actions_by_their_inputs_and_catches_orders_that_wait_forever():
    lay = layout("gpipe", 2, 1, 1)
    # Stage 1's forward waits for stage 0's (3 s), its backward gradient goes back at 3 + 1 + 5.
    times = {(0, "F", 0): 3.0, (1, "F", 0): 1.0, (1, "B", 0): 5.0, (0, "B", 0): 2.0}
    timeline = replay(lay, lambda rank, action: times[action])
    assert timeline == [
        [(0.0, 3.0, (0, "F", 0)), (9.0, 11.0, (0, "B", 0))],
        [(3.0, 4.0, (1, "F", 0)), (4.0, 9.0, (1, "B", 0))],
    ]
    # Stage 0 runs its backward before the second forward, which stage 1 needs to send it.
    stuck = Layout("custom", 2, 1, 2, {0: 0, 1: 1}, [
        [(0, "F", 0), (0, "B", 1), (0, "F", 1), (0, "B", 0)],
        [(1, "F", 0), (1, "F", 1), (1, "B", 1), (1, "B", 0)],
    ])
    with pytest.raises(ReplayStuck, match=r"no rank can move: rank 0 at 0B1, rank 1 at 1F1"):
        replay(stuck, lambda rank, action: 1.0)


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


def test_describe_shows_stages_grid_bubble_and_held_activations():
    model = MODELS["mlp"]()
    cfg = training_config(world_size=2, strategy="pipeline", batch_size=32, micro_batches=4)
    text = strategy_for(cfg).describe(cfg, model)
    stage_lines = [line for line in text.splitlines() if line.startswith("  stage ")]
    counts = [int(line.rsplit(", ", 1)[1].split()[0].replace(",", "")) for line in stage_lines]
    assert len(counts) == 2 and sum(counts) == sum(p.numel() for p in model.parameters())
    assert grid(layout("1f1b", 2, 1, 4)).splitlines()[1] in text
    assert "bubble (p-1)/(m+p-1) = 1/5 = 20.0%" in text
    assert "holds at most: stage 0 2, stage 1 1" in text
    cfg = training_config(world_size=4, dp_replicate=2, strategy="pipeline", batch_size=32, micro_batches=4,
                          schedule="interleaved-1f1b")
    text = strategy_for(cfg).describe(cfg, model)
    assert "stage 2 (ranks 0-1): layer 2 (Dense)" in text and "bubble (p-1)/(v*m+p-1) = 1/9 = 11.1%" in text
    assert "\n    ranks 2-3 " in text


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"world_size": 5}, r"training.mesh.pp 5: more pipeline stages than the model's 4 layers"),
        ({"world_size": 3, "schedule": "zbv", "micro_batches": 3},
         r"training.mesh.pp 3 x training.pipeline.stages_per_rank 2: more pipeline stages than the model's 4"),
        ({"world_size": 1}, r"training.mesh.pp 1: strategy pipeline needs at least 2 stages"),
        ({"world_size": 4, "dp_replicate": 3}, r"training.mesh dp_replicate 3 = 3 must divide training.world_size 4"),
        ({"boundaries": [1, 2]}, r"pipeline.boundaries \[1, 2\]: 2 pipeline stages need 1"),
        ({"world_size": 3, "boundaries": [2, 2]}, r"pipeline.boundaries \[2, 2\] must be increasing"),
        ({"boundaries": [4]}, r"pipeline.boundaries \[4\] must be increasing .* from 1 to 3"),
        ({"boundaries": [0]}, r"pipeline.boundaries \[0\] must be increasing"),
        ({"schedule": "interleaved-1f1b", "boundaries": [2]},
         r"pipeline.boundaries \[2\]: 4 pipeline stages need 3"),
        ({"world_size": 4, "pp": 2, "batch_size": 31}, r"batch_size 31 must be a multiple of the 2 data-parallel ranks"),
        ({"batch_size": 30}, r"training.pipeline.micro_batches 4 must divide each pipeline's batch of 30 rows"),
        ({"world_size": 3, "micro_batches": 2},
         r"training.pipeline.schedule 1f1b with training.mesh.pp 3, training.pipeline.micro_batches 2, 1 stage\(s\) per "
         r"rank: Number of microbatches \(2\) must be greater than or equal to the number of stages \(3\)"),
        ({"schedule": "interleaved-1f1b", "micro_batches": 5, "batch_size": 30},
         r"interleaved-1f1b with training.mesh.pp 2, training.pipeline.micro_batches 5, 2 stage\(s\) per rank: .*multiple"),
        ({"stages_per_rank": 2},
         r"training.pipeline.stages_per_rank 2: training.pipeline.schedule 1f1b runs exactly 1 stages per rank"),
        ({"schedule": "zbv", "stages_per_rank": 3, "hidden": [8] * 5},
         r"pipeline.stages_per_rank 3: training.pipeline.schedule zbv runs exactly 2"),
        ({"schedule": "interleaved-1f1b", "stages_per_rank": 1},
         r"pipeline.stages_per_rank 1: training.pipeline.schedule interleaved-1f1b runs 2 or more"),
    ],
)
def test_check_names_the_bad_setting(settings, message):
    hidden = settings.pop("hidden", None)
    model = TabularMLP(5, [4], hidden, 3) if hidden else MODELS["mlp"]()
    with pytest.raises(ConfigError, match=message):
        cfg = training_config(**{"world_size": 2, "strategy": "pipeline", "batch_size": 32, **settings})
        strategy_for(cfg).check(cfg, model)


# --- training on real process groups (each launch costs seconds: they are few and shared) ---

def _setup(rank: int, world_size: int, model: nn.Module, optimizer: str = "sgd", **settings):
    # These tests read what the executor did (orders, held activations): timed stages.
    settings.setdefault("timing", True)
    cfg = training_config(world_size=world_size, strategy="pipeline", **settings)
    strategy = strategy_for(cfg)
    strategy.check(cfg, model)
    return strategy.setup(model, cfg, rank, world_size, torch.device("cpu"), OPTIMIZERS[optimizer])


def _train(parallel, batches) -> None:
    for x, y in batches:
        parallel.step(x, y)  # dp 1: every rank of the pipeline reads the whole batch


def every_combination(rank: int, world_size: int, args: dict) -> dict:
    """One schedule trained with SGD and AdamW in fp32 and bf16: each run's weights, and what
    the executor recorded (each step's action order and held micro-batches, this rank's);
    then the AdamW fp32 run again, resumed after 2 of its 3 steps as the worker resumes."""
    out = {}
    batches = list(global_batches(args["steps"], args["batch"]))
    settings = {"batch_size": args["batch"], **args["cfg"]}
    for optimizer in OPTIMIZERS:
        for precision in ATOL:
            torch.manual_seed(0)
            parallel = _setup(rank, world_size, MODELS["mlp"](), optimizer, precision=precision, **settings)
            _train(parallel, batches)
            out[optimizer, precision] = parallel.full_state_dict()
            logs = parallel.clock.take()
            out["orders", precision] = [[a for a, _, _ in log.actions] for log in logs]
            out["held", precision] = [log.held for log in logs]
            out["left", precision] = sum(parallel.clock.live.values())  # saved tensors still alive
    # A training run's default: no timing (plain stages, no barrier per step). The same
    # weights as the timed run: timing only observes.
    torch.manual_seed(0)
    untimed = _setup(rank, world_size, MODELS["mlp"](), "adamw", timing=False, **settings)
    _train(untimed, batches)
    out["untimed"] = untimed.full_state_dict()
    out["untimed_stages"] = [type(stage).__name__ for stage in untimed.stages]
    out["untimed_metrics"] = untimed.epoch_metrics()
    torch.manual_seed(0)
    first = _setup(rank, world_size, MODELS["mlp"](), "adamw", **settings)
    _train(first, batches[:2])
    first.save_checkpoint(args["directory"])  # each rank its stages, through DCP
    torch.manual_seed(1)  # another start: everything must come from the checkpoint
    resumed = _setup(rank, world_size, MODELS["mlp"](), "adamw", **settings)
    resumed.load_checkpoint(args["directory"])
    _train(resumed, batches[2:])
    out["resumed"] = resumed.full_state_dict()
    return out


def single_process(args: dict, optimizer: str, precision: str) -> dict:
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    opt = OPTIMIZERS[optimizer](model.parameters())
    autocast = Precision.of(TrainingConfig(precision=precision)).autocast(torch.device("cpu"))
    for x, y in global_batches(args["steps"], args["batch"]):
        train_step(model, opt, autocast, x, y)
    return model.state_dict()


def _config(name: str) -> TrainingConfig:
    return training_config(world_size=2, strategy="pipeline", batch_size=32, schedule=name, micro_batches=4)


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory) -> dict:
    """Every schedule, 2 ranks, 4 micro-batches: one launch each, shared by the tests below."""
    runs = {}
    for name in SCHEDULES:
        args = {"steps": 3, "batch": 32, "cfg": {"schedule": name, "micro_batches": 4},
                "directory": str(tmp_path_factory.mktemp(f"ckpt-{name}"))}
        runs[name] = (args, launch_local(every_combination, args, world_size=2, timeout_s=300))
    return runs


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_matches_single_process_with_sgd_and_adamw_in_fp32_and_bf16(name, schedule_runs):
    args, ranks = schedule_runs[name]
    for optimizer in OPTIMIZERS:
        for precision, atol in ATOL.items():
            reference = single_process(args, optimizer, precision)
            for rank_result in ranks:
                _assert_close(rank_result[optimizer, precision], reference, atol=atol)
    # The check has teeth: training moved the weights.
    initial = train_steps(0, 1, {**ARGS, "steps": 0})
    assert any(not torch.allclose(initial[k], reference[k]) for k in reference)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_resume_is_bit_exact(name, schedule_runs):
    for rank_result in schedule_runs[name][1]:
        straight = rank_result["adamw", "fp32"]
        assert list(rank_result["resumed"]) == list(straight)
        for k, v in straight.items():
            assert torch.equal(rank_result["resumed"][k], v), k


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_run_is_untimed_unless_asked_and_timing_changes_no_weight(name, schedule_runs):
    """training.pipeline.timing is off by default: plain PipelineStages (no device sync around
    every action, no barrier per step), only the formula's bubble reported; the weights are
    bit-equal to the timed run's."""
    args, ranks = schedule_runs[name]
    assert not TrainingConfig().pipeline.timing
    for r in ranks:
        assert set(r["untimed_stages"]) == {"PipelineStage"}, r["untimed_stages"]
        assert set(r["untimed_metrics"]) == {"pipeline_bubble_formula"}, r["untimed_metrics"]
        timed = r["adamw", "fp32"]
        assert timed.keys() == r["untimed"].keys()
        assert all(torch.equal(timed[k], r["untimed"][k]) for k in timed)


def test_the_schedule_changes_only_the_timing(schedule_runs):
    # Every schedule sums each parameter's micro-batch gradients in the same order: equal bits.
    weights = {name: ranks[0]["sgd", "fp32"] for name, (_, ranks) in schedule_runs.items()}
    for name, w in weights.items():
        for k in w:
            assert torch.equal(w[k], weights["gpipe"][k]), (name, k)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_executor_runs_the_order_the_driver_prints(name, schedule_runs):
    printed = pipeline_layout(_config(name).pipeline, 2)  # what `describe` draws on the driver, before any process
    for r, rank_result in enumerate(schedule_runs[name][1]):
        for precision in ATOL:
            steps = rank_result["orders", precision]
            assert len(steps) == 3 and all(order == printed.orders[r] for order in steps), (r, precision)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_executor_holds_the_activations_its_schedule_implies(name, schedule_runs):
    """Measured on torch's executor (saved-tensor hooks): each stage held exactly as many
    micro-batches as its order has in flight (for 1F1B p - s on stage s, for GPipe all m),
    and nothing a step saved outlived it (zero-bubble's retained graphs included)."""
    lay = pipeline_layout(_config(name).pipeline, 2)
    expected = in_flight(lay)
    assert expected == {"gpipe": {0: 4, 1: 4}, "1f1b": {0: 2, 1: 1}}.get(name, expected)
    for r, rank_result in enumerate(schedule_runs[name][1]):
        for precision in ATOL:
            for held in rank_result["held", precision]:
                assert held == {s: expected[s] for s in lay.rank_stages(r)}, (r, precision, held)
            assert rank_result["left", precision] == 0


def several(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """train_steps for each of `runs` in turn, in one process group."""
    return [train_steps(rank, world_size, args) for args in runs]


@pytest.mark.parametrize(
    "world_size, variants",
    [
        (2, [{"model": "transformer"},
             {"model": "transformer", "cfg": {"schedule": "interleaved-1f1b"}},
             {"cfg": {"micro_batches": 1, "schedule": "gpipe"}}]),
        (4, [{"cfg": {"dp_replicate": 2, "pp": 2, "micro_batches": 2}},
             {"cfg": {"dp_replicate": 2, "pp": 2, "micro_batches": 2, "schedule": "zbv"}}]),
    ],
)
def test_pipeline_variants_match_single_process(world_size, variants):
    runs = [{**ARGS, **variant} for variant in variants]
    ranks = launch_local(several, runs, world_size=world_size, timeout_s=300)
    for i, args in enumerate(runs):
        reference = train_steps(0, 1, args)
        for rank_results in ranks:
            _assert_close(rank_results[i], reference)


def stage_report(rank: int, world_size: int, args: dict) -> dict:
    """Train, then report what this rank holds and returned."""
    torch.manual_seed(0)
    parallel = _setup(rank, world_size, MODELS[args["model"]](), batch_size=args["batch"], **args["cfg"])
    losses = []
    for x, y in global_batches(args["steps"], args["batch"]):
        out = parallel.step(x, y)
        if out is not None:
            logits, loss = out
            assert logits.shape == (args["batch"], 3)
            losses.append((loss.item(), F.cross_entropy(logits, y).item()))
    # Every parameter this rank's Parallel can reach, named as in the plain model.
    held = {name: p.numel() for stage in parallel.stages for name, p in stage.submod.named_parameters()}
    optimized = sum(p.numel() for g in parallel.optimizer.param_groups for p in g["params"]) \
        if parallel.optimizer else 0
    return {
        "held": held, "optimized": optimized, "losses": losses, "reports": parallel.reports,
        "metrics": parallel.epoch_metrics(), "full": parallel.full_state_dict(),
    }


def sums_of_the_first_steps(rank: int, world_size: int, args: dict) -> dict:
    """The built-in loop's steps (step_sums) from the start: the plain weights before each step
    and what the last stage returned."""
    from functools import partial

    from shardline.training.task import batch_sums

    torch.manual_seed(0)
    parallel = _setup(rank, world_size, MODELS["mlp"](), micro_batches=4, batch_size=36)
    steps = []
    for x, y in global_batches(2, 36):
        before = parallel.full_state_dict()
        out, sums = parallel.step_sums(x, y, partial(batch_sums, "classification"))
        steps.append({"before": before, "out": out, "sums": sums})
    return {"steps": steps, "last": parallel.last}


def test_step_sums_adds_up_the_micro_batches_as_the_whole_batch_and_keeps_no_outputs():
    # The first step calls the loss once more before its micro-batches (torch infers the
    # backward's shapes): its sums must not count. Against the plain model's batch, per step.
    from shardline.training.task import batch_sums

    ranks = launch_local(sums_of_the_first_steps, {}, world_size=2, timeout_s=120)
    assert [r["last"] for r in ranks] == [False, True]
    assert all(s["out"] is None and s["sums"] is None for s in ranks[0]["steps"])
    for (x, y), step in zip(global_batches(2, 36), ranks[1]["steps"]):
        model = MODELS["mlp"]()
        model.load_state_dict(step["before"])
        with torch.no_grad():
            logits = model(x)
        expected = batch_sums("classification", logits, y, F.cross_entropy(logits, y))
        torch.testing.assert_close(step["sums"], expected, rtol=1e-5, atol=1e-5)
        outputs, loss = step["out"]
        assert outputs is None and loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)


def three_ranks(rank: int, world_size: int, args: dict) -> dict:
    """The cnn cut by configured boundaries; the mlp's held activations under GPipe and 1F1B."""
    out = {"cnn": stage_report(rank, world_size, args)}
    for name in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        parallel = _setup(rank, world_size, MODELS["mlp"](), schedule=name, micro_batches=6, batch_size=36)
        _train(parallel, global_batches(2, 36))
        out[name] = [log.held for log in parallel.clock.take()]
    return out


@pytest.fixture(scope="module")
def on_three_ranks() -> tuple[dict, list[dict]]:
    # cnn layers: 0 FeatureInput, 1 Channels (no parameters), 2-3 ConvBlock, 4 PoolHead.
    args = {"model": "cnn", "steps": 3, "batch": 36, "cfg": {"pp": 3, "boundaries": [1, 2],
                                                            "micro_batches": 3}}
    return args, launch_local(three_ranks, args, world_size=3, timeout_s=300)


def test_1f1b_holds_p_minus_s_activations_on_the_executor_gpipe_m(on_three_ranks):
    for s, rank_result in enumerate(on_three_ranks[1]):
        assert rank_result["1f1b"] == [{s: 3 - s}] * 2
        assert rank_result["gpipe"] == [{s: 6}] * 2


def test_boundaries_from_config_decide_what_each_stage_holds(on_three_ranks):
    args, results = on_three_ranks
    ranks = [r["cnn"] for r in results]
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
        metrics = r["metrics"]
        assert metrics["pipeline_bubble_formula"] == pytest.approx(2 / 5)
        # Steps 2 and 3 measured (the first also set the schedule up): fractions of the step.
        assert 0 <= metrics["pipeline_bubble_predicted"] < 1 and 0 <= metrics["pipeline_bubble"] < 1
        _assert_close(r["full"], reference)
    # 1F1B holds p - s micro-batches on stage s; the reshape (stage 1) saves nothing for backward.
    assert [r["metrics"]["pipeline_activations_held_max"] for r in ranks] == [3, 0, 1]
