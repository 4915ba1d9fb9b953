"""Processes on this machine: the embedded default engine of training (launch). It runs
training ranks only; prepare and scoring run their tasks on Spark or Dask."""

from __future__ import annotations

import socket

from shardline.training.launchers import available_cores

from ..base import Engine, Slots, ranks_only
from .launch import launch_local


class LocalEngine(Engine):
    """Ranks as processes of this machine: nothing to open or close, every address loopback."""

    name = "local"

    @classmethod
    def open(cls, cfg=None, given=None, ranks: int | None = None) -> LocalEngine:
        return cls()

    @classmethod
    def cluster(cls, cfg, given=None) -> str | None:
        return None

    @classmethod
    def hosts_before_launch(cls, world_size: int) -> list[str] | None:
        return [socket.gethostname()] * world_size  # every rank a process of this machine

    def listen_address(self) -> str:
        return "127.0.0.1"

    def ship_code(self, code):
        return code  # the ranks read the snapshot's zip where the driver wrote it

    def slots(self, threads_per_rank: int = 1) -> Slots:
        cores = available_cores()  # a container or taskset may give this process fewer
        return Slots(cores, f"{cores} cores of this machine", per_rank=threads_per_rank)

    def run(self, fn, items: list) -> list:
        raise ranks_only(self, "prepare")

    def shuffle_write(self, sources: list, read, schema, parts: int, write, out_schema) -> list[dict]:
        raise ranks_only(self, "prepare")

    def stage_frame(self, df, folder: str) -> int:
        raise ranks_only(self, "prepare")

    def run_units(self, tasks: list) -> list[dict]:
        raise ranks_only(self, "scoring")

    def check_capacity(self, world_size: int, setting: str = "training.world_size") -> None:
        """Any number of ranks: processes share the cores (training.threads_per_rank)."""

    def launch_ranks(self, fn, payload, world_size: int, timeout_s: float, *, guard=None, code=None,
                     relaunch: bool = False, workers=None) -> list:
        return launch_local(fn, payload, world_size, timeout_s, guard, code=code)
