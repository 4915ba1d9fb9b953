"""The local launcher: ranks come from a fork server started once, yet each launch's ranks
see the launcher as it is at that launch, as freshly spawned processes would."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from shardline.training.launchers import TrainingFailed, available_cores, local
from shardline.training.launchers.local import launch_local


def report(rank: int, world_size: int, payload: dict) -> dict:
    print(f"rank {rank} of {world_size} on stdout", flush=True)
    print(f"rank {rank} of {world_size} on stderr", file=sys.stderr, flush=True)
    if payload.get("fail_rank") == rank:
        raise ValueError(f"rank {rank} fails as asked")
    return {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
            "mark": os.environ.get("SHARDLINE_LAUNCH_MARK")}


def test_ranks_see_the_launchers_environment_folder_and_output_of_now(tmp_path, monkeypatch, capfd):
    first = launch_local(report, {}, world_size=2, timeout_s=120)  # the fork server runs from here on
    assert all(r["mark"] is None for r in first)
    monkeypatch.setenv("SHARDLINE_LAUNCH_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()

    ranks = launch_local(report, {}, world_size=2, timeout_s=120)
    assert [r["mark"] for r in ranks] == ["set after the server started"] * 2
    assert [r["cwd"] for r in ranks] == [str(tmp_path)] * 2
    out, err = capfd.readouterr()
    for rank in range(2):
        assert f"rank {rank} of 2 on stdout" in out and f"rank {rank} of 2 on stderr" in err
    # Fresh processes each launch, none of them the launcher's own child (the server's).
    pids = {r["pid"] for r in first + ranks}
    assert len(pids) == 4 and os.getpid() not in {r["ppid"] for r in ranks}


def test_a_failing_rank_fails_the_launch_with_its_error():
    with pytest.raises(TrainingFailed, match=r"rank 1 on \S+: ValueError: rank 1 fails as asked"):
        launch_local(report, {"fail_rank": 1}, world_size=2, timeout_s=60)


def crash_in_native_code(rank: int, world_size: int, payload: None) -> None:
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crash inside torch or gloo would be


def test_a_rank_killed_by_native_code_prints_where_it_was(capfd):
    with pytest.raises(TrainingFailed) as failed:
        launch_local(crash_in_native_code, None, world_size=2, timeout_s=60)
    assert "rank 1 exit code -11" in str(failed.value)  # the signal still ends it
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err and "in crash_in_native_code" in err, err[-2000:]


def die_or_wait_unaware(rank: int, world_size: int, pid_dir: str) -> None:
    """Rank 1 is SIGKILLed; rank 0 waits in a way that never notices a dead peer (as a wait on
    a store key or a hung device would), far longer than this test may take."""
    with open(os.path.join(pid_dir, f"rank-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)


def test_a_killed_rank_ends_the_launch_without_waiting_for_its_survivor(tmp_path, monkeypatch):
    # Without the launcher stopping the survivor this waits out the hour and the suite's
    # timeout fails it; no time is measured here. The survivor's grace is 1 s instead of 15:
    # its length is not what this proves, only that it ends.
    monkeypatch.setattr(local, "FAILED_RANK_GRACE_S", 1.0)
    with pytest.raises(TrainingFailed) as failed:
        launch_local(die_or_wait_unaware, str(tmp_path), world_size=2, timeout_s=3600)
    assert "rank 1 exit code -9" in str(failed.value) and "rank 0 stopped by the launcher" in str(failed.value)
    assert not failed.value.permanent  # a lost rank: the job restarts
    survivor = int((tmp_path / "rank-0").read_text())
    with pytest.raises(ProcessLookupError):  # ended and reaped, not left running
        os.kill(survivor, 0)


def torch_threads(rank: int, world_size: int, payload: None) -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.skipif(available_cores() < 2, reason="one core: torch's default is already one thread a rank")
def test_ranks_share_the_cores_instead_of_each_taking_them_all(monkeypatch):
    # torch's default would give every rank one thread per core: oversubscribed, OpenMP's
    # spinning threads wait for each other's cores.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = available_cores()
    assert launch_local(torch_threads, None, world_size=2, timeout_s=60) == [max(1, cores // 2)] * 2
    assert launch_local(torch_threads, None, world_size=2 * cores, timeout_s=60) == [1] * (2 * cores)
    # A user's own OMP_NUM_THREADS, set after the fork server started, is what the ranks get.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch_local(torch_threads, None, world_size=2, timeout_s=60) == [3, 3]


# What classic Spark 4.3 raised here when the executor JVM running rank 1 of a barrier
# stage was SIGKILLed (local-cluster[2,1,1024]; the Java frames left out): Spark names the
# partition (the rank) and the executor, not the host.
LOST_EXECUTOR = """An error occurred while calling o43.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from \
a failed barrier ResultStage. Most recent failure reason: Stage failed because barrier task \
ResultTask(0, 1) finished unsuccessfully.
ExecutorLostFailure (executor 1 exited caused by one of the running tasks) Reason: Command exited with code 137
\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:3129)
"""


def test_a_lost_spark_executor_is_named_with_its_rank_executor_host_and_pid(tmp_path):
    """The restart line of a lost executor names the rank (its barrier partition), the
    executor, and the host and pid the rank announced (ranks/rank-N.json), not Py4J's
    "An error occurred while calling o43.collectToPython."."""
    import json

    from shardline.training.launchers.spark import _lost_task

    failed = TrainingFailed.from_ranks("Spark barrier stage", LOST_EXECUTOR, _lost_task(Exception(LOST_EXECUTOR)))
    assert str(failed) == (
        "Spark barrier stage training failed: rank 1 on executor 1 was lost: ExecutorLostFailure "
        "(executor 1 exited caused by one of the running tasks) Reason: Command exited with code 137"
    )
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank-1.json").write_text(json.dumps({"rank": 1, "host": "worker-b", "pid": 4242}))
    line = _lost_task(Exception(LOST_EXECUTOR), str(tmp_path))
    assert line.startswith("rank 1 on worker-b (executor 1), pid 4242 was lost: ExecutorLostFailure"), line
    assert not failed.permanent  # a lost executor is relaunched
