"""The strategies' 2-D DeviceMesh: its layout is the rank order every strategy assumes."""

from __future__ import annotations

import pytest
import torch

from shardline.engines.local.launch import launch_local
from shardline.training.strategies.base import Mesh


def mesh_ranks(rank: int, world_size: int, degrees: tuple[int, int]) -> dict:
    mesh = Mesh(*degrees, inner_name="tp")
    dm = mesh.device_mesh(torch.device("cpu"))
    return {
        "names": dm.mesh_dim_names,
        "dp": dm["dp"].mesh.tolist(),
        "tp": dm["tp"].mesh.tolist(),
        "indices": (mesh.dp_index(rank), mesh.inner_index(rank)),
        "coordinate": list(dm.get_coordinate()),
    }


@pytest.mark.parametrize("degrees", [(2, 2), (1, 2), (2, 1)])
def test_device_mesh_is_row_major_dp_by_inner(degrees):
    dp, inner = degrees
    for rank, got in enumerate(launch_local(mesh_ranks, degrees, world_size=dp * inner, timeout_s=120)):
        assert got["names"] == ("dp", "tp")
        # The ranks of one model replica are neighbours; a dp group strides by `inner`.
        assert got["tp"] == [rank // inner * inner + i for i in range(inner)]
        assert got["dp"] == [d * inner + rank % inner for d in range(dp)]
        assert list(got["indices"]) == got["coordinate"] == [rank // inner, rank % inner]
