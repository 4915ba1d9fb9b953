"""The lines a training job prints when a rank is lost, fails or is stopped: the catalog
docs/gen_ref.py renders into docs/reference/errors.md ("Training failures"). Each line is
made here by the code that makes it in a job (training.launchers.rank_errors, the launchers'
TrainingFailed, the driver guard's stop line), so the page cannot drift from them; the
tests that run the faults for real (tests/test_checkpoints.py: a rank SIGKILLed on every
launcher, tests/test_rank_lines.py: a user's forward that raises, tests/test_faults.py:
Ctrl-C) check the same shapes on real engines."""

from __future__ import annotations

import json
from typing import NamedTuple

from shardline.training.launchers import TrainingFailed
from shardline.engines.dask.launch import workers_missing
from shardline.training.launchers.guard import stop_line
from shardline.training.launchers.rank_errors import exit_reason, lost_rank

RESTART = "; restarting from ckpt-000000020-c6fa66.pt"  # training.restarts: the relaunch's own words


class Line(NamedTuple):
    what: str  # what happened
    then: str  # what shardline does
    line: str  # what it prints


def _marker(rank: int, host: str, error: str, permanent: bool, **more) -> str:
    """A rank's marker as run_in_group raises it (rank_errors.RankError)."""
    return f"<<shardline-rank {json.dumps({'rank': rank, 'host': host, 'permanent': permanent, 'error': error, **more})}>>"


def _lines() -> list[Line]:
    survivor = _marker(0, "host-a", "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer", False)
    boom = dict(error="ValueError: boom", where="mynets/nets.py, line 12, in forward")
    bug = _marker(0, "host-a", permanent=True, log="/ckpt/ranks/rank-0.log", **boom) + \
        _marker(1, "host-a", permanent=True, log="/ckpt/ranks/rank-1.log", **boom)
    full = _marker(1, "host-b", "StorageError: training.checkpoint_dir: cannot write /ckpt/ckpt-000000005-1a2b3c.pt "
                   "(OSError: [Errno 28] No space left on device)", True)
    return [
        Line("a local rank killed (a signal, the OOM killer)", "relaunched from the latest checkpoint",
             "[shardline] " + str(TrainingFailed.from_ranks(
                 "local", survivor, "no result", [lost_rank(1, "host-a", exit_reason(-9), 4242)])) + RESTART),
        Line("a Dask rank's process killed (its worker stays up)", "relaunched at once on the same workers",
             "[shardline] " + str(TrainingFailed.from_ranks(
                 "Dask", survivor, "", [lost_rank(1, "host-b", exit_reason(-9), 4242,
                                                  "worker tcp://10.0.0.2:37929")])) + RESTART),
        Line("a Dask rank's worker gone (killed, its host lost)", "relaunched once the nanny brought a worker back "
             "and its rank server is ready (each waited for up to `training.timeout_s`)",
             "[shardline] " + str(TrainingFailed.from_ranks(
                 "Dask", survivor, "", [lost_rank(1, "host-b", "its Dask worker left the cluster", 4242,
                                                  "worker tcp://10.0.0.2:37929")])) + RESTART),
        Line("a lost Dask worker not back (the relaunch waited `training.timeout_s`)", "not relaunched again: exit 1",
             "error: " + str(workers_missing(1, 2, 300))),
        Line("a Spark rank's Python worker or executor gone", "relaunched; no Java stack trace on the console",
             "[shardline] " + str(TrainingFailed.from_ranks(
                 "Spark barrier stage", "", lost_rank(1, "host-b", "Python worker exited unexpectedly (crashed)", 4242,
                                                      "executor 1"))) + RESTART),
        Line("a bug: the user's model (or shardline) raises on every rank", "not relaunched: exit 1; the full "
             "traceback of each rank in its log file under the checkpoint folder",
             "error: " + str(TrainingFailed.from_ranks("local", bug, ""))),
        Line("a rank's own permanent error (a full disk, no permission, bad data)", "not relaunched: exit 1",
             "error: " + str(TrainingFailed.from_ranks("Spark barrier stage", full, ""))),
        Line("Ctrl-C (SIGINT) to the driver", "each rank stops within a second, before it commits another "
             "checkpoint (at most one being written completes); exit 130",
             stop_line(4242, "shardline train 71839b7f", "its driver was interrupted") + " ... aborted"),
    ]


LINES = _lines()
