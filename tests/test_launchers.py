"""The local launcher: ranks come from a fork server started once, yet each launch's ranks
see the launcher as it is at that launch, as freshly spawned processes would."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass

import pytest
import torch

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


@dataclass
class WithRanksDir:
    """A payload with a `ranks_dir`, as a TrainJob has: where a bug's traceback is written."""

    ranks_dir: str


class Boom(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom: the user's forward fails")


BOOM_LINE = Boom.forward.__code__.co_firstlineno + 1


def forward_fails(rank: int, world_size: int, payload: WithRanksDir) -> None:
    Boom()(1)  # every rank: a user's deterministic bug


def test_a_bug_on_every_rank_is_one_line_naming_the_users_frame_and_the_log(tmp_path, capfd):
    ranks_dir = str(tmp_path / "ranks")
    with pytest.raises(TrainingFailed) as failed:
        launch_local(forward_fails, WithRanksDir(ranks_dir), world_size=2, timeout_s=60)
    line = str(failed.value)
    frame = f"tests/test_launchers.py, line {BOOM_LINE}, in forward"  # the user's file, relative to sys.path
    assert line == (f"local training failed: rank 0 on {socket.gethostname()}: ValueError: boom: the user's "
                    f"forward fails (at {frame}; rank 1 the same; traceback in {ranks_dir}/rank-0.log)"), line
    assert failed.value.permanent  # a deterministic bug: a relaunch would raise it again
    # The full traceback is in each rank's log, through torch's frames to the user's raise;
    # the console gets none of it.
    for rank in range(2):
        log = (tmp_path / "ranks" / f"rank-{rank}.log").read_text()
        assert log.startswith(f"rank {rank} on {socket.gethostname()}, pid ") and "torch/nn/modules/module.py" in log
        assert f'test_launchers.py", line {BOOM_LINE}, in forward' in log and log.rstrip().endswith(
            "ValueError: boom: the user's forward fails"), log
    assert "Traceback" not in capfd.readouterr().err


def crash_in_native_code(rank: int, world_size: int, payload: None) -> None:
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crash inside torch or gloo would be


def test_a_rank_killed_by_native_code_prints_where_it_was(capfd):
    with pytest.raises(TrainingFailed) as failed:
        launch_local(crash_in_native_code, None, world_size=2, timeout_s=60)
    # The signal still ends it, and the rank it killed is named first, by its signal.
    assert re.match(r"local training failed: rank 1 on \S+, pid \d+ was lost: killed by SIGSEGV "
                    r"\(exit code -11\)", str(failed.value)), str(failed.value)
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
    # The lost rank leads (not its survivor), then the survivor the launcher stopped.
    assert re.fullmatch(r"local training failed: rank 1 on \S+, pid \d+ was lost: killed by SIGKILL "
                        r"\(exit code -9\); rank 0 stopped by the launcher", str(failed.value)), str(failed.value)
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
    line = _lost_task(Exception(LOST_EXECUTOR), str(tmp_path / "ranks"))
    assert line.startswith("rank 1 on worker-b (executor 1), pid 4242 was lost: ExecutorLostFailure"), line
    assert not failed.permanent  # a lost executor is relaunched
    # A Python worker SIGKILLed in a live executor: Spark's error names no executor; the
    # status store's record of the failed task does (failed_executors, classic Spark).
    line = _lost_task(Exception(CRASHED_WORKER), str(tmp_path / "ranks"), {1: "driver"})
    assert line == "rank 1 on worker-b (executor driver), pid 4242 was lost: Python worker exited unexpectedly (crashed)"


# What classic Spark 4.3 raised when rank 1's Python worker was SIGKILLed (local[2]).
CRASHED_WORKER = """An error occurred while calling o70.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a failed \
barrier ResultStage. Most recent failure reason: Stage failed because barrier task ResultTask(0, 1) \
finished unsuccessfully.
org.apache.spark.SparkException: Python worker exited unexpectedly (crashed). Consider setting \
'spark.sql.execution.pyspark.udf.faulthandler.enabled' or'spark.python.worker.faulthandler.enabled' \
configuration to 'true' for the better Python traceback.
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator$$anonfun$1.applyOrElse(PythonRunner.scala:1136)
"""


def test_a_peer_that_failed_alike_is_read_from_its_log_of_this_attempt_only(tmp_path, monkeypatch):
    """#53 item 16: Spark and Dask report one failed rank; the others' logs say whether they
    failed the same way. A log older than its rank's start (rank-N.json) is an earlier attempt's."""
    from shardline.training.launchers import rank_errors
    from shardline.training.launchers.rank_errors import RankError

    monkeypatch.setattr(rank_errors, "ALIKE_WAIT_S", 0.3)  # how long it waits for a log is not what this shows
    ranks = tmp_path / "ranks"
    try:
        Boom()(1)
    except ValueError as e:
        marker, reported = str(RankError.of(1, e, str(ranks))), e
    (ranks / "rank-1.json").write_text("{}")
    (ranks / "rank-0.log").write_text("rank 0 on h, pid 1, then\nTraceback ...\nValueError: an older bug\n")
    time.sleep(0.05)
    (ranks / "rank-0.json").write_text("{}")  # rank 0 started again after it wrote that log
    failed = TrainingFailed.from_ranks("Spark barrier stage", marker, "", ranks_dir=str(ranks))
    assert "the same" not in str(failed), str(failed)
    RankError.of(0, reported, str(ranks))  # now rank 0 fails alike, in this attempt
    failed = TrainingFailed.from_ranks("Spark barrier stage", marker, "", ranks_dir=str(ranks))
    assert str(failed) == (
        f"Spark barrier stage training failed: rank 1 on {socket.gethostname()}: ValueError: boom: the user's "
        f"forward fails (at tests/test_launchers.py, line {BOOM_LINE}, in forward; rank 0 the same; "
        f"traceback in {ranks}/rank-1.log)"), str(failed)
    assert failed.permanent
