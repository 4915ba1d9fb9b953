"""`shardline.distribute`: a function written for torchrun or PySpark's TorchDistributor,
unchanged, on local processes, a Spark barrier stage or Dask workers, with shardline's restarts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from shardline.config import ShardlineConfig, cluster_of
from shardline.engines import ENGINES, Engines
from shardline.foundation.errors import ConfigError
from shardline.stages import run_distributed


def distribute(fn: Callable, *args: Any, num_processes: int = 1, spark=None, client=None,
               launcher: str | None = None, checkpoint_dir: str | None = None, resume: bool = False,
               max_restarts: int = 2, timeout_s: int = 300, code_paths: Iterable[str] = (), **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` on `num_processes` ranks; return rank 0's return value.

    As under torchrun and `TorchDistributor(num_processes=N).run(fn, *args)`: each rank gets
    `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`
    in its environment, and no process group: `fn` joins it itself,
    `dist.init_process_group("gloo")` (`init_method="env://"`, the default). A group it
    leaves open is closed after it returns.

    Where: `spark=` (a SparkSession, classic or Connect: one barrier stage), `client=` (a
    Dask client: one rank per worker), else `launcher` — "local" (processes of this machine,
    the default), "spark" (the active session, else an embedded one) or "dask" (an
    embedded LocalCluster, closed after).

    A function defined in a notebook or a script's `__main__` travels by value
    (cloudpickle, as TorchDistributor sends it); one an importable module defines, by its
    import path, its package shipped with the job (and `code_paths`, folders of more of
    your own code the ranks import). The arguments and the return value travel by value.

    Restarts: a lost rank (a killed process, a lost executor or worker) relaunches every
    rank, `max_restarts` times; the function starts again. With `checkpoint_dir` (a URL, or
    a path on the driver) it checkpoints through shardline: `ctx = shardline.context()`,
    `ctx.save(state, step=)` and `ctx.restore(state)` (DCP through the checkpoint store;
    the restarted function gets the last committed one). Without, it restarts from its own
    files, or from the start. A new call starts the folder over (refusing another job's);
    `resume=True` continues from its last checkpoint.

    `timeout_s`: the process group's timeout when `shardline.context()` joins the group
    for the function. Bad input (not callable, arguments it does not take, num_processes
    < 1, both spark and client) is one line (ConfigError) before anything starts.
    """
    launcher = _launcher(launcher, spark, client)
    from shardline.training.distributed import DistributedJob  # torch: only when distributing

    cfg = ShardlineConfig()
    job = DistributedJob.resolve(
        fn, args, kwargs, num_processes=num_processes, launcher=launcher, checkpoint_dir=checkpoint_dir,
        resume=resume, max_restarts=max_restarts, timeout_s=timeout_s, code_paths=list(code_paths),
        cluster=cluster_of(cfg, [launcher], spark, client),
    )
    with Engines(cfg, spark, client, (launcher, num_processes)) as engines:
        return run_distributed(job, engines.get(launcher, "launcher"))


def _launcher(launcher: str | None, spark, client) -> str:
    """The launcher: the kind of engine given, else `launcher`, else local; one line for a clash."""
    given = {name for name, handle in (("spark", spark), ("dask", client)) if handle is not None}
    if len(given) > 1:
        raise ConfigError("shardline.distribute: give spark= (a SparkSession) or client= (a Dask client), not both")
    if given and launcher is not None and launcher not in given:
        raise ConfigError(f"shardline.distribute: launcher={launcher!r} with a {given.pop()} engine given: "
                          "give the engine of that launcher, or leave launcher unset")
    if launcher is not None and launcher not in ENGINES:  # before cluster_of asks the engine by this name
        *first, last = map(repr, ENGINES)
        raise ConfigError(f"shardline.distribute: launcher: Input should be {', '.join(first)} or {last} "
                          f"(got {launcher!r})")
    return next(iter(given)) if given else launcher or "local"
