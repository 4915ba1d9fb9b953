"""One rank per Dask worker: tasks pinned to worker addresses, port picked on rank 0's host."""

from __future__ import annotations

from typing import Any

from shardline.pipelines.code_travel import UserCode, ship_to_dask
from shardline.pipelines.errors import ShardlineError

from ..placement import Slot, host_of, own_visible_gpus, slots
from . import DriverGuard, RankFn, TrainingFailed, free_port, run_in_group


def _rendezvous_address() -> str:
    # Runs on rank 0's worker: the port must be free where the store will bind it.
    from distributed import get_worker

    host = host_of(get_worker().address)
    return f"tcp://{host}:{free_port(host)}"


def _visible_devices() -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def dask_slots(client, chosen: list[str]) -> list[Slot]:
    """Each rank's slot: its host from its worker's address, and device 0 for a worker
    whose CUDA_VISIBLE_DEVICES lists a GPU of its own first (dask-cuda: each worker sees
    its own GPU as device 0; by local rank, two ranks would share one)."""
    try:
        visible = client.run(_visible_devices, workers=chosen)
    except Exception as e:  # a worker lost since it was chosen: a relaunch picks others
        raise TrainingFailed(f"Dask training failed: {type(e).__name__}: {e}") from e
    hosts = [host_of(a) for a in chosen]
    own = own_visible_gpus(hosts, [visible.get(a) for a in chosen])
    return slots(hosts, own, "its Dask worker's CUDA_VISIBLE_DEVICES (dask-cuda)")


def check_dask_workers(client, world_size: int) -> list[str]:
    workers = sorted(client.scheduler_info()["workers"])
    if world_size > len(workers):
        raise ShardlineError(
            f"training.world_size {world_size} is greater than the {len(workers)} Dask workers "
            f"of {client.scheduler.address}"
        )
    return workers


def launch_dask(
    client,
    fn: RankFn,
    payload: Any,
    world_size: int,
    timeout_s: float = 300,
    wait_s: float = 0,
    workers: list[str] | None = None,
    guard: DriverGuard | None = None,
    code: UserCode | None = None,
) -> list[Any]:
    """Run `fn` on `world_size` Dask workers, one rank each; return the results by rank.

    wait_s: how long to wait for enough workers (a relaunch after a killed worker
    waits for its nanny to bring a new one up, under a new address). workers: the
    workers to use (a sweep gives each concurrent trial its own); default the first ones.
    code: the job's snapshot of the user's code (pipelines.code_travel), uploaded to the
    workers and made current in each rank before `fn` runs.
    """
    ship_to_dask(client, code)
    if wait_s:
        try:
            client.wait_for_workers(world_size, timeout=wait_s)
        except Exception:
            pass  # still too few: refused just below with a clear message
    live = check_dask_workers(client, world_size)
    chosen = [w for w in workers or [] if w in live][:world_size]
    if len(chosen) < world_size:
        # None given, or one is gone (a nanny restarts a killed worker under a new
        # address): a task pinned to a gone worker would wait forever.
        chosen = live[:world_size]
    placed = dask_slots(client, chosen)
    init = client.submit(_rendezvous_address, workers=[chosen[0]], allow_other_workers=False, pure=False)
    init_method = init.result()
    futures = [
        client.submit(
            run_in_group, fn, rank, world_size, init_method, payload, timeout_s, guard, slot=placed[rank],
            code=code,
            workers=[addr], allow_other_workers=False, pure=False, key=f"shardline-rank-{rank}-{init.key}",
        )
        for rank, addr in enumerate(chosen)
    ]
    try:
        return client.gather(futures)
    except Exception as e:
        for f in futures:
            f.cancel()
        # The first failed rank's error; the others' were cancelled with it.
        raise TrainingFailed.from_ranks("Dask", str(e), f"{type(e).__name__}: {e}") from e
