"""A rank's failure as the one line the driver prints.

**Transient or permanent.** `run_in_group` turns a rank's exception into a `RankError`
whose text carries a marker (rank, host, whether a restart can fix it, the error's first
line, and for a bug the frame it was raised in and where its traceback was written). It
survives every launcher's way of reporting a failure: a queue (local), a pickled exception
(Dask), a Python traceback inside a Java one (Spark). `rank_failures` reads the markers
back on the driver. Only a lost peer (a killed process, a broken connection, a timeout)
is transient; a permission error, a full disk, bad data or config, or a bug (a user's
`forward` that raises included: a relaunch replays the same batches on the same weights)
fails the same way again.

**Who is named first.** A rank that was *lost* (killed, its worker or executor gone)
says nothing itself, and its peers only report that a connection closed. The launcher
names it from what it saw (an exit code, a worker that left, Spark's failed task) and the
line leads with it: `rank 1 on host-b, pid 4242 was lost: killed by SIGKILL (exit code -9)`.
A rank's own permanent error leads over everything (it is the cause); the peers' "connection
closed" is said only when no rank is known lost.

**One line for a bug.** An exception that is neither bad input nor storage (a bug in the
user's model or in shardline) is said once, with the innermost frame of the user's code
(file relative to its folder on sys.path, line, function), and its full traceback goes to
the rank's log file, `ranks/rank-N.log` in the checkpoint folder (every host writes there,
through foundation.storage, as it writes `ranks/rank-N.json`); the line names that file.
Ranks that failed with the same error at the same place are named together.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import sysconfig
import time
import traceback

from shardline.foundation import failures
from shardline.foundation.errors import first_line

_MARK = re.compile(r"<<shardline-rank (\{.*?\})>>")
# How long the driver waits for a peer's log when a rank's bug is reported (alike_in_logs).
ALIKE_WAIT_S = 3.0
_LOST_PEER_TEXT = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out",
                   "timed out", "Connection refused", "Socket Timeout")


class RankError(Exception):
    """A rank's failure, with the marker the driver reads (one string arg: it pickles)."""

    @classmethod
    def of(cls, rank: int, e: BaseException, ranks_dir: str | None = None) -> RankError:
        """The marker of `e` on this rank; a bug's traceback is written under `ranks_dir`."""
        info = {"rank": rank, "host": socket.gethostname(), "permanent": is_permanent(e),
                "error": first_line(e, with_type=True)}
        if is_bug(e):
            info["where"] = user_frame(e)
            info["log"] = write_rank_log(ranks_dir, rank, e)
        return cls(f"<<shardline-rank {json.dumps(info)}>>")


def is_permanent(e: BaseException) -> bool:
    """Would a relaunch from the last checkpoint fail the same way?"""
    from shardline.foundation.errors import ShardlineError

    from . import TrainingFailed

    if isinstance(e, RankError):
        return any(f["permanent"] for f in rank_failures(str(e)))
    if isinstance(e, ShardlineError) and not isinstance(e, TrainingFailed):
        return True  # bad config, data or storage, or a lease another job took over
    if isinstance(e, ConnectionError | TimeoutError | EOFError):
        return False
    if failures.is_permanent(e):  # the rule prepare, scoring and storage use too
        return True
    text = str(e)
    if _is_dist_error(e) or any(t in text for t in _LOST_PEER_TEXT):
        return False  # a peer is gone: the relaunch brings it back
    return not isinstance(e, KeyboardInterrupt | SystemExit)


def is_bug(e: BaseException) -> bool:
    """A failure the user cannot fix from its one line (not bad input or storage, not a lost peer)."""
    from shardline.foundation.errors import ShardlineError

    return is_permanent(e) and not isinstance(e, OSError | ShardlineError | RankError)


def _is_dist_error(e: BaseException) -> bool:
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    return dist_error is not None and isinstance(e, dist_error)


# -- a bug's place and its traceback ----------------------------------------------------------


def _library_roots() -> tuple[str, ...]:
    """Folders whose code is not the user's: the standard library, installed packages, shardline's own."""
    import shardline
    from shardline import pipelines, training

    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]}
    roots |= {os.path.dirname(m.__file__) for m in (shardline, pipelines, training)}
    return tuple(os.path.realpath(r) + os.sep for r in roots)


def user_frame(e: BaseException, users_only: bool = False) -> str | None:
    """Where `e` was raised in the user's code: "mynets/nets.py, line 12, in forward" (the
    innermost frame outside the standard library, installed packages and shardline), else
    (unless `users_only`) the innermost frame outside the standard library; None for an
    exception with no frames."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
    roots = _library_roots()
    stdlib = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
    mine = [f for f in frames if not os.path.realpath(f.filename).startswith(roots)]
    if users_only:
        frames = mine
    chosen = (mine or [f for f in frames if not os.path.realpath(f.filename).startswith(stdlib)] or frames)
    if not chosen:
        return None
    f = chosen[-1]
    return f"{_relative(f.filename)}, line {f.lineno}, in {f.name}"


def _relative(filename: str) -> str:
    """The file as its import path names it (relative to its sys.path folder): the same on
    every host, wherever the code was shipped to."""
    real = os.path.realpath(filename)
    best = None
    for entry in sys.path:
        root = os.path.realpath(entry or os.getcwd()) + os.sep
        if real.startswith(root) and (best is None or len(root) > len(best)):
            best = root
    return real[len(best):] if best else filename


def write_rank_log(ranks_dir: str | None, rank: int, e: BaseException) -> str | None:
    """The full traceback in `ranks_dir`/rank-N.log; its URL, or None when there is no such
    folder or it cannot be written (then the traceback goes to this process's stderr: the
    console for local ranks, the executor's or worker's log on a cluster)."""
    text = "".join(traceback.format_exception(e))
    if ranks_dir:
        from shardline.foundation import storage

        url = storage.join(ranks_dir, f"rank-{rank}.log")
        head = (f"rank {rank} on {socket.gethostname()}, pid {os.getpid()}, "
                f"{time.strftime('%Y-%m-%d %H:%M:%S %z')}\n")
        try:
            storage.write_bytes(url, (head + text).encode())
            return url
        except Exception as write_error:  # noqa: BLE001 - the traceback must still go somewhere
            text += f"\n(not written to {storage.display(url)}: {first_line(write_error, with_type=True)})\n"
    print(text, file=sys.stderr, flush=True)
    return None


# -- the driver's line ------------------------------------------------------------------------


def rank_failures(text: str) -> list[dict]:
    """The rank markers in an error's text, one per rank (the first seen)."""
    found: dict[int, dict] = {}
    for m in _MARK.finditer(text):
        try:
            info = json.loads(m.group(1))
        except ValueError:
            continue
        found.setdefault(info["rank"], info)
    return [found[r] for r in sorted(found)]


def alike_in_logs(ranks_dir: str | None, failures: list[dict]) -> list[dict]:
    """The other ranks that failed as a reported bug did, from their own logs: a Spark stage
    reports its first failed task, a Dask gather its first failed rank, so "rank 0 the same"
    is read where each rank wrote it (its `rank-N.log`, ending in the same error and holding
    the same frame). A log counts when it was written in this attempt: not before that
    rank's `rank-N.json` (written when it started, training.checkpoints.store.announce).
    A peer may still be writing as the first failure arrives: up to ALIKE_WAIT_S for it."""
    bugs = [f for f in failures if f.get("log") and f["permanent"]]
    if not ranks_dir or not bugs:
        return []
    known = {f["rank"] for f in failures}
    deadline = time.monotonic() + ALIKE_WAIT_S
    while True:
        alike, waiting = _alike_now(ranks_dir, bugs, known)
        if not waiting or time.monotonic() >= deadline:
            return alike
        time.sleep(0.2)


def _alike_now(ranks_dir: str, bugs: list[dict], known: set[int]) -> tuple[list[dict], bool]:
    """(ranks alike so far, whether a started rank has written no log of this attempt yet)."""
    from shardline.foundation import storage

    try:
        files = {i.base_name: i.mtime_ns or 0 for i in storage.list_dir_info(ranks_dir)}
    except Exception:  # noqa: BLE001 - the line is said without them
        return [], False
    alike, waiting = [], False
    for name, started in files.items():
        m = re.fullmatch(r"rank-(\d+)\.json", name)
        if not m or int(m[1]) in known:
            continue
        log = f"rank-{m[1]}.log"
        if files.get(log, -1) < started:  # none yet, or an earlier attempt's
            waiting = True
            continue
        try:
            text = storage.read_bytes(storage.join(ranks_dir, log)).decode(errors="replace")
        except Exception:  # noqa: BLE001
            continue
        last = " ".join(next((ln for ln in reversed(text.splitlines()) if ln.strip()), "").split())
        same = next((f for f in bugs if last == f["error"] and _holds_frame(text, f.get("where"))), None)
        if same is not None:
            alike.append({**same, "rank": int(m[1]), "log": None})
    return alike, waiting


def _holds_frame(log: str, where: str | None) -> bool:
    """Whether a traceback holds the frame `where` names ("pkg/nets.py, line 12, in forward")."""
    if not where:
        return True
    path, _, rest = where.partition(", line ")
    return f'{path}", line {rest}' in log


def lost_rank(rank: int, host: str, why: str, pid: int | None = None, where: str = "") -> str:
    """A rank that died without a word: "rank 1 on host-b (executor 1), pid 4242 was lost: why"."""
    return f"rank {rank} on {host}{f' ({where})' if where else ''}{f', pid {pid}' if pid else ''} was lost: {why}"


def exit_reason(code: int) -> str:
    """A process's exit code as a person says it: "killed by SIGKILL (exit code -9)"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exit code {code}"


def describe_failures(failures: list[dict], lost: list[str] = ()) -> str:
    """One line: a rank's own permanent error if any (the cause), then the ranks that were
    lost; the peers' lost connections only when no rank is known lost."""
    from shardline.foundation import storage

    permanent = [f for f in failures if f["permanent"]]
    shown = permanent or ([] if lost else failures)
    parts, said = [], {}
    for f in shown:
        key = (f["error"], f.get("where"))
        if key in said:
            said[key]["also"].append(f["rank"])
            continue
        said[key] = {**f, "also": []}
        parts.append(said[key])
    lines = []
    for f in parts:
        notes = [f"at {f['where']}"] if f.get("where") else []
        if f["also"]:
            notes.append(f"rank{'s' if len(f['also']) > 1 else ''} "
                         f"{', '.join(map(str, f['also']))} the same")
        if f.get("log"):
            notes.append(f"traceback in {storage.display(f['log'])}")
        lines.append(f"rank {f['rank']} on {f['host']}: {f['error']}" + (f" ({'; '.join(notes)})" if notes else ""))
    return "; ".join(lines + list(lost))
