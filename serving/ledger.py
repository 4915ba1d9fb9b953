"""The output directory: one Parquet file per input unit, and a ledger saying which are done.

Layout (a local directory or an object store prefix):

    scores-<unit id>-<model tag>.parquet   one whole-object write (locally: temp name + rename)
    _ledger/<unit id>.json                 written after its output file: the commit point
    _lease.json                            the lease of the job writing here (pipelines.lease)

Both names depend only on the unit and the model, and both contents only on the
unit, the model and the job's `scored_at` (fixed on the driver): a retried or
duplicated task rewrites the same bytes under the same names. An output file no
ledger entry names is an interrupted unit; the next job removes it or rewrites it
under the same name. Readers that must not see such a file read through
`committed_files` (plain Parquet readers skip `_` and `.` names, so they see only
scores-*.parquet files).
"""

from __future__ import annotations

import hashlib
import json

from pipelines import storage
from pipelines.lease import LEASE_NAME, Lease

LEDGER = "_ledger"
PREFIX = "scores-"
_OLD_LOCK = "_lock"  # the flock file of outputs written before leases


def model_tag(model_name: str, model_version: str) -> str:
    return hashlib.sha256(f"{model_name}\0{model_version}".encode()).hexdigest()[:8]


def output_name(unit_id: str, model_name: str, model_version: str) -> str:
    return f"{PREFIX}{unit_id}-{model_tag(model_name, model_version)}.parquet"


def _ours(n: str) -> bool:
    return n in (LEDGER, LEASE_NAME, _OLD_LOCK) or n.startswith((PREFIX, f".{PREFIX}"))


def check_output_dir(out: str) -> None:
    """Refuse a directory holding files we did not make: we delete our leftovers there."""
    storage.check_ours(
        out, _ours,
        "output directory holds files that are not shardline scores (found {found}); "
        "choose another output directory",
    )


def read_ledger(out) -> dict[str, dict]:
    """Committed units by unit id."""
    d = storage.join(str(out), LEDGER)
    entries = {}
    for n in storage.list_dir(d):
        if n.startswith(".") or not n.endswith(".json"):
            continue  # a temp file of an interrupted write: not committed
        try:
            entry = json.loads(storage.read_bytes(storage.join(d, n)))
        except (OSError, json.JSONDecodeError):
            continue  # a torn entry cannot exist (whole-object writes); treat anything odd as uncommitted
        entries[entry["unit_id"]] = entry
    return entries


def committed_files(out) -> list[str]:
    return sorted(storage.join(str(out), e["output"]) for e in read_ledger(out).values())


def entry_bytes(entry: dict) -> bytes:
    """The entry as it is stored: the same entry gives the same bytes."""
    return json.dumps(entry, sort_keys=True).encode()


def commit(out: str, entry: dict) -> None:
    """Record a unit whose output file is already in place (idempotent: same name, same bytes)."""
    storage.write_bytes(storage.join(out, LEDGER, f"{entry['unit_id']}.json"), entry_bytes(entry))


def forget(out: str, entries: list[dict]) -> None:
    """Drop units: ledger entry first, so a crash leaves an orphan file, never a dangling entry."""
    for e in entries:
        storage.delete(storage.join(out, LEDGER, f"{e['unit_id']}.json"))
    for e in entries:
        storage.delete(storage.join(out, e["output"]))


def remove_orphans(out: str, ledger: dict[str, dict]) -> None:
    """Output and temp files of interrupted units (only ever our own names)."""
    named = {e["output"] for e in ledger.values()}
    for n in storage.list_dir(out):
        if n.startswith(f".{PREFIX}") or (n.startswith(PREFIX) and n not in named):
            storage.delete(storage.join(out, n))
    for n in storage.list_dir(storage.join(out, LEDGER)):
        if n.startswith("."):
            storage.delete(storage.join(out, LEDGER, n))


def output_lease(out) -> Lease:
    """The output's lease: one scoring job writes here at a time; a second is refused at
    once naming the holder; a dead holder's lease is taken over (pipelines.lease)."""
    return Lease(storage.join(str(out), LEASE_NAME), "shardline score", what="scoring output")
