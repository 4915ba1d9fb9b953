"""N processes on this machine: the embedded default launcher."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import traceback
from typing import Any

from . import RankFn, TrainingFailed, free_port, run_in_group


def _rank_main(fn, rank, world_size, init_method, payload, timeout_s, results):
    try:
        result = run_in_group(fn, rank, world_size, init_method, payload, timeout_s)
        # Plain pickle bytes: a queue would pass tensors as shared memory that dies
        # with this process before the parent reads it.
        results.put((rank, pickle.dumps(result), None))
    except BaseException as e:  # report, then fail the process
        results.put((rank, None, f"{type(e).__name__}: {e}"))
        traceback.print_exc()
        raise SystemExit(1)


def launch_local(fn: RankFn, payload: Any, world_size: int, timeout_s: float = 300) -> list[Any]:
    """Run `fn` on `world_size` spawned processes; return the results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, init_method, payload, timeout_s, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got, errors = {}, []
    # Drain before join: a process with a large result in the queue cannot exit first.
    while len(got) + len(errors) < world_size:
        try:
            rank, result, err = results.get(timeout=2)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
            continue
        if err:
            errors.append(f"rank {rank}: {err}")
        else:
            got[rank] = pickle.loads(result)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if errors or len(got) < world_size:
        dead = [f"rank {r} exit code {p.exitcode}" for r, p in enumerate(procs) if p.exitcode]
        raise TrainingFailed("local training failed: " + "; ".join(errors or dead or ["no result"]))
    return [got[r] for r in range(world_size)]
