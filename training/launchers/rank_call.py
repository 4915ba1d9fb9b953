"""What a rank process runs, handed over in a file: never through the caller's `__main__`.

A launcher writes one file per rank (`write_call`) and starts a process that reads it
(`run_file`: the rank server's child, training.launchers.rank_server), as torchrun hands a
fresh interpreter a module to run rather than re-running the caller's script. The file holds
three pickles, read in order:

1. the process's setup, plain data (environment, working folder, `sys.path`): applied
   before anything else is unpickled, so the rest imports what the launcher's process
   would (a test's module, the worker's shipped zip);
2. the user's code snapshot (foundation.code_travel.UserCode), located on this host by
   the launcher's side (a Dask worker's files folder is known to the worker, not its child);
3. the call itself, pickled with cloudpickle: the rank function and its payload travel by
   value when they were defined in the caller's `__main__` (a script's own loop function),
   by reference otherwise.

The rank's result (or its error's text: a RankError marker) comes back the same way, in
a file beside, written whole (a temporary name, then renamed): a killed rank leaves none.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import sys
from dataclasses import dataclass
from typing import Any

import cloudpickle

from shardline.foundation.code_travel import UserCode

from ..placement import Slot
from . import LOST_PEER_GRACE_S, DriverGuard, RankFn, available_cores, run_in_group


@dataclass
class RankCall:
    """One rank's `run_in_group` arguments, and how its process shares this host's cores."""

    fn: RankFn
    rank: int
    world_size: int
    init_method: str
    payload: Any
    timeout_s: float
    guard: DriverGuard | None = None
    lost_peer_grace_s: float = LOST_PEER_GRACE_S
    slot: Slot | None = None
    # The local launcher's ranks share this machine's cores (see _torch_threads); a Dask
    # worker's rank keeps the threads its worker was given (its nanny's OMP_NUM_THREADS).
    share_cores: bool = False


def setup_here() -> dict:
    """This process's environment, folder and import path: what its rank process gets."""
    return {"env": dict(os.environ), "cwd": os.getcwd(), "sys_path": import_path()}


def import_path() -> list[str]:
    """This process's sys.path for a process it starts (a rank, its server), each entry
    absolute, less any MLflow model's code folder that holds a copy of shardline. MLflow's
    `load_model` of a shardline model (a notebook's, a Dask worker's scoring task) leaves the
    model's code folder (`<model>/code`, beside its `MLmodel`), with the copy of shardline's
    engine packages it was logged with, first on sys.path: this process keeps the shardline it
    imported, but a process started from it would import that partial, older copy instead.
    Only a model's folder is left out: a Dask worker runs shardline from the zip its client
    shipped, beside a folder of the user's (its working folder) that may hold another
    checkout of shardline and the user's own modules."""
    path = []
    for entry in sys.path:
        entry = entry or os.getcwd()
        in_a_model = os.path.isfile(os.path.join(os.path.dirname(os.path.normpath(entry)), "MLmodel"))
        if in_a_model and os.path.isfile(os.path.join(entry, "shardline", "__init__.py")):
            continue
        path.append(entry)
    return path


def write_call(path: str, call: RankCall | bytes, code: UserCode | None, setup: dict | None = None) -> None:
    """`call`: a RankCall, or one already pickled (pickled_call) by a driver elsewhere."""
    blob = call if isinstance(call, bytes) else pickled_call(call)
    with open(path, "wb") as f:
        pickle.dump(setup or setup_here(), f)
        pickle.dump(code, f)
        f.write(blob)


def pickled_call(call: RankCall) -> bytes:
    return cloudpickle.dumps(call)


def run_file(call_path: str, result_path: str) -> int:
    """In the rank's process: run the call of `call_path`, write its outcome to `result_path`;
    the process's exit code (0: a result; 1: an error, its text written)."""
    with open(call_path, "rb") as f:
        setup = pickle.load(f)
        # The launcher's environment and folder of now, as a freshly spawned process would
        # have them (e.g. GLOO_SOCKET_IFNAME set after the server started).
        os.environ.clear()
        os.environ.update(setup["env"])
        os.chdir(setup["cwd"])
        sys.path[:] = setup["sys_path"]
        code = pickle.load(f)
        call: RankCall = pickle.load(f)
    # A rank that native code kills (SIGSEGV in torch, gloo or a library) prints its threads'
    # Python stacks first: the launcher alone sees only "exit code -11".
    faulthandler.enable()
    if call.share_cores:
        _torch_threads(call.world_size)
    try:
        result = run_in_group(call.fn, call.rank, call.world_size, call.init_method, call.payload, call.timeout_s,
                              call.guard, lost_peer_grace_s=call.lost_peer_grace_s, slot=call.slot, code=code)
        outcome, status = ("ok", result), 0
    except BaseException as e:  # reported, then the process fails
        # A RankError: its marker says rank, host and cause (a bug's traceback is in its log file).
        outcome, status = ("error", str(e) or repr(e)), 1
    _write_whole(result_path, cloudpickle.dumps(outcome))
    return status


def read_result(path: str) -> tuple[str, Any] | None:
    """("ok", result) or ("error", text) as the rank wrote it; None if it wrote nothing (killed)."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def _write_whole(path: str, data: bytes) -> None:
    tmp = f"{path}.part"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _torch_threads(world_size: int) -> None:
    """This machine's cores shared among the ranks, at least one thread each; or the
    launcher's OMP_NUM_THREADS if it has one (torchrun, too, keeps a value it is given).

    torch starts one intra-op thread per core in every process, so world_size ranks on one
    machine would run world_size x cores threads, and OpenMP's threads spin while they wait
    for each other's cores. Measured on 2 cores (tests/test_equivalence.py): 4 ranks of
    DTensor dp x tp training took 19.4 s with torch's default and 4.4 s with this, 2 ranks
    of tensor parallel 6.2 s and 1.8 s. torchrun sets OMP_NUM_THREADS=1 for the same
    reason; Spark's Python workers get OMP_NUM_THREADS = spark.task.cpus (seen: 1) and
    Dask's nannies 1. A rank function may set its own (run_rank: training.threads_per_rank).
    Set here, not left to torch: torch read the rank server's environment, of its start."""
    import torch  # the rank server's, already imported

    given = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(given) if given.isdigit() and int(given) > 0
                          else max(1, available_cores() // world_size))
