"""`shardline.distribute`'s job on the driver: a function written for torchrun or PySpark's
TorchDistributor, resolved and checked once, then run on every rank with shardline's restarts.

`resolve` checks everything that can refuse the call and writes nothing: the function and
its arguments, the settings, and the checkpoint folder when one is given (another job's
checkpoints in it are refused; `resume` needs one of this function's). `run` then holds the
folder (one job per folder), starts it over (a new call) and launches the ranks: a lost
rank relaunches them all (training.restarts), and the function, started again, finds the
last checkpoint its context committed (`shardline.context().restore(state)`), or its own
files. The value is rank 0's, as TorchDistributor's `run` returns it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shardline.foundation import storage
from shardline.foundation.code_travel import UserCode, snapshot
from shardline.foundation.errors import ConfigError, DataError
from shardline.foundation.progress import ProgressListener

from .checkpoints.store import CheckpointStore
from .config import TrainingConfig
from .launchers import DriverGuard
from .loop.call import FunctionCall
from .loop.function import LoopFunction
from .loop.runner import RankJob
from .restarts import launch_with_restarts
from .user_code import job_code_folders, refresh_driver_code

WHO = "shardline.distribute"


@dataclass
class DistributedJob:
    """One `shardline.distribute` call on the driver (see the module docstring)."""

    cfg: TrainingConfig  # launcher, world_size, checkpoint_dir, max_restarts, timeout_s, code_paths
    call: FunctionCall
    store: CheckpointStore | None  # None: no checkpoint_dir given
    fingerprint: dict[str, str]
    code: UserCode
    resume_from: str | None = None

    @classmethod
    def resolve(cls, fn: Callable, args: tuple, kwargs: dict, *, num_processes: int, launcher: str,
                checkpoint_dir: str | None, resume: bool, max_restarts: int, timeout_s: int,
                code_paths: list[str], cluster: str | None = None) -> DistributedJob:
        """Every check, in the order a user would fix them; nothing written. `cluster`: the
        non-local master or scheduler the ranks run on (a relative checkpoint_dir is refused)."""
        _check_function(fn, args, kwargs)
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
            raise ConfigError(f"{WHO}: num_processes must be a whole number of at least 1 (got {num_processes!r})")
        if resume and checkpoint_dir is None:
            raise ConfigError(f"{WHO}: resume=True needs the checkpoint_dir to resume from")
        fn_travels = LoopFunction.travelling(fn)
        url = storage.resolve(str(checkpoint_dir), "checkpoint_dir", cluster) if checkpoint_dir is not None else None
        cfg = _settings(launcher=launcher, world_size=num_processes, max_restarts=max_restarts, timeout_s=timeout_s,
                        code_paths=list(code_paths), resume=resume,
                        # Its package ships with the job when it travels by reference (training.user_code).
                        loop=None if fn_travels.by_value else fn_travels.path,
                        **({"checkpoint_dir": url} if url else {}))
        call = FunctionCall(fn_travels, _pickled_arguments(args, kwargs), checkpoints=url is not None)
        code = snapshot(job_code_folders(cfg))
        refresh_driver_code(code)  # the driver imports what the ranks will (an edited module: its new code)
        job = cls(cfg, call, CheckpointStore(url) if url else None, {"function": fn_travels.path}, code)
        job._check_folder()
        return job

    def _check_folder(self) -> None:
        """A new call: no other job's checkpoints in the folder (starting over would delete
        them). A resume: this function's newest readable checkpoint."""
        store = self.store
        if store is None:
            return
        if not self.cfg.resume:
            store.check_new(self.fingerprint)
            return
        found = store.readable(self.fingerprint)
        if found is None:
            raise DataError(f"checkpoint_dir {store.where}: no checkpoint to resume from")
        self.resume_from = found[0]

    def check_capacity(self, engine) -> None:
        """Enough task slots or workers for every rank on `engine` (shardline.engines.base.Engine)."""
        engine.check_capacity(self.cfg.world_size)

    def run(self, engine) -> Any:
        """Launch the ranks on `engine` (relaunch them from the last checkpoint when one is
        lost); rank 0's value."""
        import cloudpickle

        store, cfg = self.store, self.cfg
        held = store.hold(cfg.lease_ttl_s) if store is not None else None
        try:
            guard = (DriverGuard.for_this_process(held.url, store.stop_file, held.job, held.ttl_s)
                     if held is not None and store is not None else None)
            if store is not None and self.resume_from is None:
                store.start_over(self.fingerprint)  # a new call: this function's earlier checkpoints go
            job = RankJob(cfg=cfg, dataset_dir="", fingerprint=self.fingerprint, code=self.code,
                          resume_from=self.resume_from, call=self.call)
            # ctx.say's lines reach this process's reporter wherever the ranks run (foundation.progress).
            with ProgressListener(engine.listen_address()) as listener:
                job.progress_addr = listener.address
                result = launch_with_restarts(job, store, engine, guard=guard)
            return cloudpickle.loads(result["value"])
        finally:
            if store is not None:
                store.release()


def _check_function(fn: Callable, args: tuple, kwargs: dict) -> None:
    """A callable that takes the arguments given (as TorchDistributor's run(fn, *args) calls it)."""
    if not callable(fn):
        raise ConfigError(f"{WHO}: the function to run is not callable (it is a {type(fn).__name__})")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(fn, "__name__", repr(fn))
        raise ConfigError(f"{WHO}: {name}{signature} does not take the arguments given ({e})") from None


def _pickled_arguments(args: tuple, kwargs: dict) -> bytes:
    """The arguments by value, as TorchDistributor sends them (cloudpickle); one line if they cannot be."""
    import cloudpickle

    try:
        return cloudpickle.dumps((args, kwargs))
    except Exception as e:  # noqa: BLE001 - any object's own pickling error: said in the line
        raise ConfigError(f"{WHO}: the function's arguments cannot be sent to the ranks "
                          f"({type(e).__name__}: {e})") from None


def _settings(**values) -> TrainingConfig:
    """The training settings a distributed job uses, validated; one line naming the argument."""
    try:
        return TrainingConfig.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        name = {"world_size": "num_processes"}.get(str(err["loc"][0]), str(err["loc"][0]))
        got = f" (got {err['input']!r})" if isinstance(err.get("input"), (str, int, float, bool)) else ""
        raise ConfigError(f"{WHO}: {name}: {err['msg'].removeprefix('Value error, ')}{got}") from None
