"""Parallelisms composed on one DeviceMesh (#55): dp_shard x tp, pp x tp and pp x dp_shard at 4
ranks, and dp_shard x tp x pp at 8, each against single-process training of the same model on
the same batches, on the built-in decoder and on a user's model by import path; the refusals of
a mesh that does not fit the model; the grid `shardline plan` prints and a run logs.

"Matches" is tests/test_equivalence.py's measure: the relative distance ||w - w_ref|| /
||w_ref|| over all weights after the steps, w_ref single-process training; SGD in fp32 lands
within 1e-6 (measured worst here 1.2e-7) and an unsynchronised rank (half of each batch
alone) far outside it, which the test checks.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardline.foundation.errors import ConfigError
from shardline.engines.local.launch import launch_local
from shardline.training.models.decoder import Decoder
from shardline.training.strategies import strategy_for

from .dist_helpers import MODELS, relative_distance, train_steps, train_variants, training_config, unsynchronised

TOLERANCE = 1e-6  # SGD fp32: tests/test_equivalence.py
USERMODELS = Path(__file__).parent / "usermodels"
USER = {"model": "usernets.nets:build", "cfg": {"model_args": {"width": 16, "depth": 2}}}

MESHES_AT_4 = {
    "dp_shard x tp": {"mesh": {"dp_shard": 2, "tp": 2}},
    "pp x tp": {"mesh": {"pp": 2, "tp": 2}, "micro_batches": 2},
    "pp x dp_shard": {"mesh": {"pp": 2, "dp_shard": 2}, "micro_batches": 2},
}


def _check_matches(common: dict, variants: list[dict], ranks: list[list[dict]]) -> None:
    reference = train_steps(0, 1, common)
    for i, variant in enumerate(variants):
        for rank, weights in enumerate(ranks):
            distance = relative_distance(weights[i], reference)
            assert distance <= TOLERANCE, (variant["cfg"], rank, distance)
    # The tolerance has teeth: one data part of each batch alone lands far outside it.
    assert relative_distance(unsynchronised(common, 2), reference) > 3 * TOLERANCE


def own_loop(rank: int, world_size: int, args: dict) -> dict:
    """What a user's own loop does with `ctx.prepare` (MeshStrategy.prepare_module: apply_mesh):
    its own seeded model made a dp_shard 2 x tp 2 one, its own forward, loss and SGD step on
    the rank's part of each batch; the plain weights after (torch's state-dict API)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from shardline.training.batch import forward, take
    from shardline.training.task import next_token_loss

    from .dist_helpers import batches_of

    cfg = training_config(world_size=world_size, batch_size=args["batch"], model="decoder", **args["cfg"])
    strategy = strategy_for(cfg)
    torch.manual_seed(0)
    model = strategy.prepare_module(MODELS["decoder"](), cfg, world_size, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    part, parts = strategy.mesh.data_rank(rank), strategy.mesh.data_world
    local = args["batch"] // parts
    for x, y in batches_of(args):
        rows = slice(part * local, (part + 1) * local)
        loss = next_token_loss(forward(model, take(x, rows)), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def meshes_and_own_loop(rank: int, world_size: int, args: dict) -> list[dict]:
    return [*train_variants(rank, world_size, args), own_loop(rank, world_size, {**args, **args["variants"][0]})]


def test_meshes_at_4_ranks_match_single_process_on_the_decoder():
    """One launch of 4 ranks, the three meshes one after the other in its process group, then a
    user's own loop on the first of them (ctx.prepare's function)."""
    common = {"strategy": "ddp", "steps": 3, "batch": 16, "model": "decoder"}
    variants = [{"cfg": settings} for settings in MESHES_AT_4.values()]
    ranks = launch_local(meshes_and_own_loop, {**common, "variants": variants}, world_size=4, timeout_s=300)
    _check_matches(common, [*variants, {"cfg": "own loop"}], ranks)


def test_a_pipeline_mesh_is_no_module_for_an_own_loop():
    cfg = training_config(world_size=4, model="decoder", mesh={"pp": 2, "tp": 2})
    with pytest.raises(ConfigError, match=r"training.mesh.pp 2: a pipeline runs its stages by its schedule"):
        strategy_for(cfg).prepare_module(MODELS["decoder"](), cfg, 4, torch.device("cpu"))


@pytest.mark.slow
def test_meshes_at_4_ranks_match_single_process_on_a_users_model(monkeypatch):
    """Full tier only (marker `slow`): a second launch of 4 ranks (~10 CPU-s) for the user's
    model by import path, its own tp_plan(), pipeline_layers() and fsdp_units(); the quick
    tier keeps the built-in decoder's (above) and every 1-D strategy on this model
    (tests/test_user_model.py)."""
    monkeypatch.chdir(USERMODELS)  # the ranks import the user's package from the job's folder
    common = {"strategy": "ddp", "steps": 4, "batch": 16, **USER}
    variants = [{"cfg": {**USER["cfg"], **settings}} for settings in MESHES_AT_4.values()]
    ranks = launch_local(train_variants, {**common, "variants": variants}, world_size=4, timeout_s=300)
    _check_matches(common, variants, ranks)


@pytest.mark.slow
def test_dp_shard_x_tp_x_pp_at_8_ranks_matches_single_process_on_the_decoder_and_a_users_model(monkeypatch):
    """Full tier only (marker `slow`): 8 ranks on 2 cores (~40 CPU-s), the 3-D mesh on both
    models in one launch; the quick tier keeps the 2-D meshes (above)."""
    monkeypatch.chdir(USERMODELS)
    mesh = {"mesh": {"dp_shard": 2, "tp": 2, "pp": 2}, "micro_batches": 2}
    runs = [{"strategy": "ddp", "steps": 4, "batch": 16, "model": "decoder", "cfg": mesh},
            {"strategy": "ddp", "steps": 4, "batch": 16, "model": USER["model"], "cfg": {**USER["cfg"], **mesh}}]
    ranks = launch_local(several, runs, world_size=8, timeout_s=600)
    for i, args in enumerate(runs):
        reference = train_steps(0, 1, args)
        for rank, results in enumerate(ranks):
            assert relative_distance(results[i], reference) <= TOLERANCE, (args["model"], rank)


def several(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    return [train_steps(rank, world_size, args) for args in runs]


@pytest.mark.parametrize(
    "settings, message",
    [
        # A tp pair cut apart by a stage boundary: the mlp's Dense 1 (colwise) and 2 (rowwise).
        ({"world_size": 4, "model": "mlp", "mesh": {"pp": 2, "tp": 2}, "boundaries": [2]},
         r"^training.mesh.pp 2: colwise '1.linear' \(stage 0\) and the rowwise '2.linear' that closes it \(stage 1\) "
         r"are cut apart"),
        ({"world_size": 4, "model": "decoder", "mesh": {"pp": 2, "dp_shard": 2}, "schedule": "zbv", "micro_batches": 2},
         r"^training.pipeline.schedule zbv with sharded data-parallel pipelines \(training.mesh pp 2 x dp_shard 2\)"),
        ({"world_size": 4, "model": "decoder", "mesh": {"tp": 2, "dp_shard": 2}, "grad_compression": "fp16"},
         r"^training.ddp.grad_compression fp16: DDP's communication hook, for a mesh of plain replicas"),
        ({"world_size": 8, "model": "decoder", "mesh": {"pp": 8}},
         r"^training.mesh.pp 8: more pipeline stages than the model's 4 layers"),
        ({"world_size": 4, "model": "decoder", "mesh": {"tp": 4}, "heads": 2},
         r"^training.mesh.tp 4 must divide training.heads"),
    ],
)
def test_a_mesh_the_model_cannot_take_is_refused_in_one_line(settings, message):
    name = settings.pop("model")
    cfg = training_config(batch_size=16, model=name, **settings)
    model = Decoder(32, 12, d_model=16, heads=cfg.heads, layers=2) if name == "decoder" else MODELS[name]()
    with pytest.raises(ConfigError, match=message) as err:
        strategy_for(cfg).check(cfg, model)
    assert "\n" not in str(err.value)


def _manifest(shards: int):
    """What the grid reads of a manifest: the train split's shards."""
    files = [SimpleNamespace(path=f"train/part-{i:04d}.parquet", rows=100) for i in range(shards)]
    return SimpleNamespace(split=lambda name: SimpleNamespace(shards=files))


def test_the_grid_shows_each_ranks_coordinates_host_stage_tensor_shard_and_files():
    cfg = training_config(world_size=8, launcher="local", model="decoder", mesh={"dp_shard": 2, "tp": 2, "pp": 2})
    torch.manual_seed(0)
    hosts = [f"host{r // 4}" for r in range(8)]
    text = strategy_for(cfg).grid(cfg, MODELS["decoder"](), _manifest(4), hosts)
    title, header, *rows = text.splitlines()
    assert title.startswith("mesh: pp 2 x dp_shard 2 x tp 2 = 8 rank(s)") and "each batch read in 2 part(s)" in title
    assert header.split()[:5] == ["rank", "pp", "dp_shard", "tp", "host"]
    assert len(rows) == 8
    for rank, row in enumerate(rows):
        pp, shard, tp = rank // 4, rank // 2 % 2, rank % 2
        assert row.split()[:5] == [str(rank), str(pp), str(shard), str(tp), f"host{rank // 4}"], row
        # The decoder's 4 layers (embed, block0, block1, head) cut in two stages.
        assert ("stage 0: layers 0-1 (embed, block0)" if pp == 0 else "stage 1: layers 2-3 (block1, head)") in row
        # Each stage holds one block: its 6 split Linear layers, this rank's tp slice; FSDP half.
        assert f"tp {tp + 1}/2 of 6 split Linear layers, FSDP {shard + 1}/2 of each parameter" in row
        # Data part = the dp_shard index: shards r, r+2 of the 4 files.
        assert f"part {shard + 1}/2: part-{shard:04d}.parquet, part-{shard + 2:04d}.parquet (200 rows)" in row
    # ps has no mesh: workers read, servers hold parameters.
    ps = training_config(world_size=3, strategy="ps")
    lines = strategy_for(ps).grid(ps, MODELS["mlp"](), _manifest(2), None).splitlines()
    assert "(at launch, spark)" in lines[2] and "part 1/2" in lines[2] and "nothing (holds parameters)" in lines[4]
