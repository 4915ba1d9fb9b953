"""The output directory: one Parquet file per input unit, and a ledger saying which are done.

Layout:

    scores-<unit id>-<model tag>.parquet   written to a temp name, then os.replace'd
    _ledger/<unit id>.json                 written after its output file: the commit point
    _lock                                  flock'ed by the job that writes here

An output file no ledger entry names is an interrupted unit; the next job
removes it or rewrites it under the same name. Readers that must not see such
a file read through `committed_files` (plain Parquet readers skip `_` and `.`
names, so they see only scores-*.parquet files).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import uuid
from pathlib import Path

from pipelines.errors import DataError, ShardlineError
from pipelines.manifest import fsync_dir

LEDGER = "_ledger"
LOCK = "_lock"
PREFIX = "scores-"


def model_tag(model_name: str, model_version: str) -> str:
    return hashlib.sha256(f"{model_name}\0{model_version}".encode()).hexdigest()[:8]


def output_name(unit_id: str, model_name: str, model_version: str) -> str:
    return f"{PREFIX}{unit_id}-{model_tag(model_name, model_version)}.parquet"


def _ours(p: Path) -> bool:
    return p.name in (LEDGER, LOCK) or p.name.startswith((PREFIX, f".{PREFIX}"))


def check_output_dir(out: Path) -> None:
    """Refuse a directory holding files we did not make: we delete our leftovers there."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"{out}: output path exists and is not a directory")
    foreign = sorted(p.name for p in out.iterdir() if not _ours(p))
    if foreign:
        raise DataError(
            f"{out}: output directory holds files that are not shardline scores "
            f"(found {foreign[0]!r}); choose another output directory"
        )


def read_ledger(out: Path) -> dict[str, dict]:
    """Committed units by unit id."""
    d = out / LEDGER
    if not d.is_dir():
        return {}
    entries = {}
    for p in d.glob("*.json"):
        try:
            entry = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a torn entry cannot exist (os.replace); treat anything odd as uncommitted
        entries[entry["unit_id"]] = entry
    return entries


def committed_files(out: str | os.PathLike) -> list[str]:
    return sorted(str(Path(out) / e["output"]) for e in read_ledger(Path(out)).values())


def commit(out: Path, entry: dict) -> None:
    """Record a unit whose output file is already in place (idempotent: same name)."""
    d = out / LEDGER
    d.mkdir(exist_ok=True)
    tmp = d / f".{entry['unit_id']}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        json.dump(entry, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / f"{entry['unit_id']}.json")
    fsync_dir(d)


def forget(out: Path, entries: list[dict]) -> None:
    """Drop units: ledger entry first, so a crash leaves an orphan file, never a dangling entry."""
    for e in entries:
        (out / LEDGER / f"{e['unit_id']}.json").unlink(missing_ok=True)
    for e in entries:
        (out / e["output"]).unlink(missing_ok=True)


def remove_orphans(out: Path, ledger: dict[str, dict]) -> None:
    """Output and temp files of interrupted units (only ever our own names)."""
    named = {e["output"] for e in ledger.values()}
    for p in out.iterdir():
        if p.name.startswith(f".{PREFIX}") or (p.name.startswith(PREFIX) and p.name not in named):
            p.unlink(missing_ok=True)
    for p in (out / LEDGER).glob(".*.tmp") if (out / LEDGER).is_dir() else ():
        p.unlink(missing_ok=True)


class OutputLock:
    """Exclusive, non-blocking: a second job on the same output fails at once, not later."""

    def __init__(self, out: Path):
        self.path = out / LOCK
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise ShardlineError(
                f"{self.path.parent}: another scoring job is writing to this output directory"
            ) from None
        return self

    def __exit__(self, *exc) -> None:
        # The kernel drops the lock when the process dies, so a crash never leaves it held.
        os.close(self.fd)

