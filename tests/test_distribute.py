"""`shardline.distribute` (#52 item 4): a function written for torchrun / PySpark's
TorchDistributor, run unchanged on shardline's launchers, with shardline's restarts.

The functions are a user's package outside shardline (tests/usermodels/distfns): they read
torchrun's variables and join the process group themselves. Costs (idle 2-core machine): the
quick tier's local run ~3 s, its refusals ~0 s; the full tier's TorchDistributor comparison
~25 s (TorchDistributor ~8 s, then local, the session's Spark and Dask), each kill test ~10 s.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

import shardline
from shardline.foundation.errors import ConfigError, DataError

USERMODELS = Path(__file__).parent / "usermodels"


@pytest.fixture
def distfns(monkeypatch):
    """The user's package importable here (a user's own checkout on the path) and in
    processes started from here (TorchDistributor's torchrun)."""
    monkeypatch.syspath_prepend(str(USERMODELS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(USERMODELS), os.environ.get("PYTHONPATH")])))
    from distfns import fns

    yield fns
    for name in [m for m in sys.modules if m.split(".")[0] == "distfns"]:
        del sys.modules[name]


def test_a_function_for_torchrun_runs_unchanged_and_returns_rank_0s_value(tmp_path):
    def train(scale, offset=0.0):  # defined here: it travels by value (cloudpickle)
        import os

        import torch
        import torch.distributed as dist

        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        # The group is left open: shardline closes it (a reused Spark worker must not keep it).
        return {"sum": t.item() * scale + offset, "env": env, "master": os.environ["MASTER_ADDR"]}

    out = shardline.distribute(train, 2.0, num_processes=2, offset=1.0)
    assert out == {"sum": 7.0, "env": {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
                   "master": "127.0.0.1"}
    assert "RANK" not in os.environ  # the driver's environment is its own


@pytest.mark.parametrize("call, message", [
    (lambda: shardline.distribute(3, num_processes=2), r"the function to run is not callable \(it is a int\)"),
    (lambda: shardline.distribute(lambda n: n, 1, num_processes=0), r"num_processes must be a whole number of at "
                                                                 r"least 1 \(got 0\)"),
    (lambda: shardline.distribute(lambda n: n, num_processes=2), r"<lambda>\(n\) does not take the arguments "
                                                                 r"given \(missing a required argument: 'n'\)"),
    (lambda: shardline.distribute(lambda: 1, spark=object(), client=object()),
     r"give spark= \(a SparkSession\) or client= \(a Dask client\), not both"),
    (lambda: shardline.distribute(lambda: 1, launcher="ray"), r"launcher: Input should be 'spark', 'dask' or "
                                                              r"'local' \(got 'ray'\)"),
    (lambda: shardline.distribute(lambda: 1, resume=True), r"resume=True needs the checkpoint_dir to resume from"),
    (lambda: shardline.distribute(lambda x: 1, threading.Lock()), r"the function's arguments cannot be sent to the "
                                                                  r"ranks \(TypeError: cannot pickle"),
])
def test_bad_input_is_one_line_before_anything_starts(call, message):
    with pytest.raises(ConfigError, match=r"^shardline\.distribute: " + message):
        call()


def test_a_folder_of_another_job_or_nothing_to_resume_is_refused(tmp_path, distfns):
    with pytest.raises(DataError, match=r"checkpoint_dir \S+: no checkpoint to resume from"):
        shardline.distribute(distfns.checkpointed, 4, 2, checkpoint_dir=str(tmp_path / "none"), resume=True)
    assert not (tmp_path / "none").exists()  # a refusal writes nothing


@pytest.mark.slow
def test_one_unchanged_function_gives_torch_distributors_result_on_every_launcher(
        distfns, spark, dask_client, tmp_path):
    """Full tier only (marker `slow`, ~25 s): PySpark's own TorchDistributor (torchrun and
    fresh interpreters) beside shardline.distribute on the local launcher, the session's
    Spark and the session's Dask; the function, importable, travels by reference there,
    its package shipped with the job."""
    from pyspark.ml.torch.distributor import TorchDistributor

    want = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(distfns.train_linear, 5, lr=0.05)
    assert want["world"] == 2 and want["env"] == list(distfns.ENV)
    for handles in ({}, {"spark": spark}, {"client": dask_client}):
        got = shardline.distribute(distfns.train_linear, 5, num_processes=2, lr=0.05, **handles)
        assert got["env"] == want["env"] and got["world"] == 2, handles
        for k, v in want["weights"].items():
            assert torch.equal(torch.tensor(got["weights"][k]), torch.tensor(v)), (handles, k)


@pytest.mark.slow
@pytest.mark.parametrize("through", ["context", "own file"])
def test_a_rank_killed_mid_run_restarts_from_the_last_checkpoint(distfns, tmp_path, through, capfd):
    """Full tier only (marker `slow`, ~10 s each): a kill test. Rank 1 SIGKILLed after the
    first checkpoint; every rank relaunched, the function started again finds it (through
    shardline.context().restore, or its own file) and ends on the uninterrupted weights."""
    from .test_checkpoints import LOST, _kill_rank_after_first_checkpoint

    def run(name: str, **kw):
        own = str(tmp_path / f"{name}.pt") if through == "own file" else None
        return shardline.distribute(distfns.checkpointed, 30, 5, own, num_processes=2,
                                    checkpoint_dir=str(tmp_path / name), **kw)

    want = run("whole")
    done, killed = threading.Event(), []
    if through == "own file":  # the function's own file stands for the first checkpoint
        watch = _kill_when_written(tmp_path / "killed.pt", tmp_path / "killed" / "ranks" / "rank-1.json", done,
                                   killed)
    else:
        watch = threading.Thread(target=_kill_rank_after_first_checkpoint,
                                 args=(tmp_path / "killed", 1, done, killed))
    watch.start()
    try:
        got = run("killed", pause_s=0.1, max_restarts=1)
    finally:
        done.set()
        watch.join()
    assert killed, "the rank was never killed"
    restarts = [ln for ln in capfd.readouterr().err.splitlines() if "restarting from" in ln]
    where = r"ckpt-\d{9}-[0-9a-f]{6}\.pt" if through == "context" else \
        re.escape("the start (the function has committed no checkpoint: shardline.context().save)")
    assert len(restarts) == 1 and re.match(
        r"\[shardline\] " + LOST["local"].format(pid=killed[0]) + "; restarting from " + where + "$", restarts[0]), \
        restarts
    for k, v in want.items():
        assert torch.equal(torch.tensor(got[k]), torch.tensor(v)), k


def _kill_when_written(path: Path, announced: Path, done: threading.Event, killed: list) -> threading.Thread:
    """A watcher that SIGKILLs the rank that announced itself at `announced` once `path` exists."""
    import json
    import signal
    import time

    def watch():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not done.is_set():
            if path.exists() and announced.exists():
                pid = json.loads(announced.read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.005)

    return threading.Thread(target=watch)
