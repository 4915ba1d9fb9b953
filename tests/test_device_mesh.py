"""The job's one DeviceMesh: its shape's rank layout (pp outermost, tp innermost) is torch's,
and a config's strategy name and [training.mesh] resolve to the mesh the docs promise."""

from __future__ import annotations

import pytest
import torch

from shardline.engines.local.launch import launch_local
from shardline.foundation.errors import ConfigError
from shardline.training.config import TrainingConfig
from shardline.training.mesh_shape import DIMENSIONS, MeshShape, mesh_of, split_tp_groups
from shardline.training.strategies.parallelize import device_mesh

SHAPES = [MeshShape(pp=2, tp=2), MeshShape(dp_replicate=2, dp_shard=2), MeshShape(pp=2, dp_shard=2)]


def mesh_ranks(rank: int, world_size: int, shapes: list[MeshShape]) -> list[dict]:
    """For each shape: this rank's coordinate in torch's DeviceMesh and the ranks of each of its 1-D sub-meshes."""
    out = []
    for shape in shapes:
        dm = device_mesh(shape, torch.device("cpu"))
        out.append({"names": dm.mesh_dim_names, "coordinate": list(dm.get_coordinate()),
                    "groups": {d: dm[d].mesh.tolist() for d in DIMENSIONS}})
    return out


def test_torchs_device_mesh_lays_ranks_out_as_the_shape_says():
    for rank, got in enumerate(launch_local(mesh_ranks, SHAPES, world_size=4, timeout_s=120)):
        for shape, mesh in zip(SHAPES, got):
            assert mesh["names"] == DIMENSIONS
            assert mesh["coordinate"] == [shape.coordinates(rank)[d] for d in DIMENSIONS]
            for d in DIMENSIONS:
                assert mesh["groups"][d] == shape.group(rank, (d,)), (shape, d)


def test_tp_is_innermost_pp_outermost_and_data_ranks_count_replicas_then_shards():
    shape = MeshShape(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    assert shape.world == 16 and shape.data_world == 4
    # A tp group is neighbours (one host when hosts fill with consecutive ranks).
    assert shape.group(5, ("tp",)) == [4, 5]
    # A pipeline's positions are a whole stage's ranks apart.
    assert shape.group(5, ("pp",)) == [5, 13]
    assert shape.coordinates(13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 1}
    assert shape.rank_at(pp=1, dp_replicate=1, tp=1) == 13
    assert [shape.data_rank(r) for r in (0, 2, 4, 6, 8, 14)] == [0, 1, 2, 3, 0, 3]
    # One rank per data part reports its loss: tp 0 on the last stage.
    assert [r for r in range(16) if shape.reports(r)] == [8, 10, 12, 14]
    assert shape.named() == "pp 2 x dp_replicate 2 x dp_shard 2 x tp 2"


def test_a_tp_group_split_across_hosts_is_found():
    """The GPU path's tp-within-a-host check (strategies.mesh.check_tp_hosts), on made-up hosts."""
    shape = MeshShape(dp_shard=2, tp=2)
    assert split_tp_groups(shape, ["a", "a", "b", "b"]) == []  # consecutive ranks on each host
    assert split_tp_groups(shape, ["a", "b", "a", "b"]) == [[0, 1], [2, 3]]  # interleaved executors
    assert split_tp_groups(MeshShape(tp=4), ["a", "a", "a", "b"]) == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    "settings, shape",
    [
        ({"strategy": "ddp", "world_size": 4}, MeshShape(dp_replicate=4)),
        ({"strategy": "fsdp", "world_size": 4}, MeshShape(dp_shard=4)),
        ({"strategy": "tensor", "world_size": 2}, MeshShape(tp=2)),
        ({"strategy": "pipeline", "world_size": 2}, MeshShape(pp=2)),
        # The strategy's own dimension takes what the others leave ...
        ({"strategy": "fsdp", "world_size": 4, "mesh": {"dp_replicate": 2}}, MeshShape(dp_replicate=2, dp_shard=2)),
        ({"strategy": "ddp", "world_size": 4, "mesh": {"dp_shard": 2, "tp": 2}}, MeshShape(dp_shard=2, tp=2)),
        ({"world_size": 8, "mesh": {"dp_shard": 2, "tp": 2, "pp": 2}}, MeshShape(pp=2, dp_shard=2, tp=2)),
        # ... and given too, the replicas do.
        ({"strategy": "tensor", "world_size": 4, "mesh": {"tp": 2}}, MeshShape(dp_replicate=2, tp=2)),
        ({"strategy": "pipeline", "world_size": 4, "mesh": {"pp": 2, "tp": 2}}, MeshShape(pp=2, tp=2)),
    ],
)
def test_a_strategy_name_is_a_shorthand_for_a_mesh(settings, shape):
    assert mesh_of(TrainingConfig(**settings)) == shape


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"world_size": 2, "mesh": {"dp_shard": 2, "tp": 2}},
         r"^training.mesh dp_shard 2 x tp 2 = 4 must divide training.world_size 2$"),
        ({"strategy": "tensor", "world_size": 6, "mesh": {"tp": 2, "dp_replicate": 2}},
         r"^training.mesh dp_replicate 2 x tp 2 = 4 must equal training.world_size 6$"),
        ({"strategy": "ps", "world_size": 3, "mesh": {"tp": 2}}, r"^training.mesh.tp = 2: strategy 'ps' has no device mesh"),
    ],
)
def test_a_mesh_that_does_not_fit_the_world_is_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message):
        mesh_of(TrainingConfig(**settings))
