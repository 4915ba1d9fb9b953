"""training.socket_ifname: exported as GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME around a rank's
process group, put back after (a Spark or Dask worker outlives the job); a name this host lacks
is refused in one line naming the setting. The bed (tests/test_multihost.py) uses it across hosts."""

from __future__ import annotations

import os

import pytest

from shardline.foundation.errors import ConfigError
from shardline.training.config import TrainingConfig
from shardline.training.launchers import run_in_group
from shardline.training.launchers.network import VARIABLES, socket_interface


def _seen(rank, world_size, payload):
    return {v: os.environ.get(v) for v in VARIABLES}


def test_the_setting_is_exported_while_the_group_lives_and_put_back_after(monkeypatch):
    from shardline.training.loop.runner import RankJob

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "before")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    job = RankJob(cfg=TrainingConfig(socket_ifname="lo"), dataset_dir="unused")
    from shardline.training.launchers import free_port

    seen = run_in_group(_seen, 0, 1, f"tcp://127.0.0.1:{free_port()}", job, 30)
    assert seen == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert os.environ["GLOO_SOCKET_IFNAME"] == "before" and "NCCL_SOCKET_IFNAME" not in os.environ


def test_unset_leaves_the_environment_alone(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "cluster-choice")
    with socket_interface(None):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "cluster-choice"


def test_an_interface_this_host_lacks_is_one_line_naming_the_setting():
    with pytest.raises(ConfigError) as e:
        with socket_interface("lo,nosuchif0"):
            pass
    msg = str(e.value)
    assert msg.startswith("training.socket_ifname 'lo,nosuchif0': no interface nosuchif0 on host ")
    assert "\n" not in msg and "lo" in msg.split("(it has ")[1]
