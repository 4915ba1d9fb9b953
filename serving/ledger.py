"""The output directory: scores kept per model version, each with a ledger of what is done.

Layout (a local directory or an object store prefix):

    model=<name>/version=<V>/scores-<unit id>.parquet   one whole-object write
    model=<name>/version=<V>/_ledger/<unit id>.json     written after its output file: the commit
    _lease.json                                         the lease of the job writing here

A unit's ledger entry is keyed by the unit and the version (its path names both), so
when an alias moves to a new version, that version scores into its own directory and
never touches an earlier version's scores. The `model=`/`version=` names are Hive
partitions: Spark, pyarrow and DuckDB read the whole output with `model` and `version`
columns. Names are percent-encoded (a `runs:/` URI has slashes).

Both names depend only on the unit and the version, and both contents only on the
unit, the model and the job's `scored_at` (fixed on the driver): a retried or
duplicated task rewrites the same bytes under the same names. An output file no
ledger entry names is an interrupted unit; the next job removes it or rewrites it
under the same name. Readers that must not see such a file read through
the ledger (plain Parquet readers skip `_` and `.` names, so they see only
scores-*.parquet files).

Outputs of shardline before per-version directories hold one version's scores at the
top (`scores-<unit id>-<tag>.parquet`, `_ledger/`): they are read as that version's,
left where they are, and discarded only by `--force`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

from shardline.foundation import storage
from shardline.foundation.errors import DataError
from shardline.foundation.lease import LEASE_NAME, Lease

LEDGER = "_ledger"
PREFIX = "scores-"
MODEL_DIR, VERSION_DIR = "model=", "version="
_OLD_LOCK = "_lock"  # the flock file of outputs written before leases


def version_dir(out: str, model_name: str, model_version: str) -> str:
    return storage.join(
        str(out), f"{MODEL_DIR}{quote(model_name, safe='')}", f"{VERSION_DIR}{quote(model_version, safe='')}"
    )


def output_name(unit_id: str) -> str:
    return f"{PREFIX}{unit_id}.parquet"


def _ours(n: str) -> bool:
    # A lease write cut short by a SIGKILL leaves its temporary: ours, removed by the next holder.
    return (n in (LEDGER, LEASE_NAME, _OLD_LOCK) or n.startswith((MODEL_DIR, PREFIX, f".{PREFIX}"))
            or storage.is_temp_of(n, LEASE_NAME))


def check_output_dir(out: str) -> None:
    """Refuse a directory holding files we did not make: we delete our leftovers there."""
    storage.check_ours(
        out, _ours,
        "output directory holds files that are not shardline scores (found {found}); "
        "choose another output directory",
    )


@dataclass
class Scores:
    """One model version's committed scores in an output: where, and its ledger by unit id."""

    model_name: str
    model_version: str
    dir: str
    entries: dict[str, dict] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(e["rows"] for e in self.entries.values())

    def describe(self) -> str:
        return (f"model {self.model_name} version {self.model_version}: {len(self.entries)} unit(s), "
                f"{self.rows:,} rows in {storage.display(self.dir)}")


def read_ledger(d) -> dict[str, dict]:
    """Committed units of one version's directory by unit id."""
    ledger = storage.join(str(d), LEDGER)
    entries = {}
    for n in storage.list_dir(ledger):
        if n.startswith(".") or not n.endswith(".json"):
            continue  # a temp file of an interrupted write: not committed
        entry = _load_entry(storage.join(ledger, n))
        if entry is not None:
            entries[entry["unit_id"]] = entry
    return entries


def read_entry(d: str, unit_id: str) -> dict | None:
    """One unit's committed entry in a version directory, None if it has none."""
    path = storage.join(d, LEDGER, f"{unit_id}.json")
    return _load_entry(path) if storage.exists(path) else None


def _load_entry(path: str) -> dict | None:
    try:
        entry = json.loads(storage.read_bytes(path))
    except (OSError, json.JSONDecodeError):
        return None  # a torn entry cannot exist (whole-object writes); treat anything odd as uncommitted
    _check_names(entry, path)
    return entry


# The only names shardline writes: a unit id (16 hex digits; older ones any word) and its
# output file beside the ledger. Nothing with '/', '..' or a leading '.' matches.
_UNIT_ID = re.compile(r"[A-Za-z0-9_-]+")
_OUTPUT = re.compile(rf"{PREFIX}[A-Za-z0-9_-]+\.parquet")


def _check_names(entry, path: str) -> None:
    """An entry's names are joined to paths and deleted (`forget`): anyone who can write the
    store could point them elsewhere (../../, an absolute path). Refuse, never follow."""
    stem = storage.name(path)[: -len(".json")]
    if not isinstance(entry, dict):
        bad = "it is not a JSON object"
    elif not (isinstance(entry.get("unit_id"), str) and _UNIT_ID.fullmatch(entry["unit_id"])
              and entry["unit_id"] == stem):
        bad = f"unit_id {entry.get('unit_id')!r} is not its file's name ({stem!r})"
    elif not (isinstance(entry.get("output"), str) and _OUTPUT.fullmatch(entry["output"])):
        bad = f"output {entry.get('output')!r} is not a {PREFIX}<unit>.parquet name in its folder"
    else:
        return
    raise DataError(
        f"{storage.display(path)}: corrupt scoring ledger entry ({bad}); nothing was deleted or "
        "followed: remove that entry (its unit is scored again) or restore it"
    )


def all_scores(out) -> list[Scores]:
    """Every model version's scores in the output, by name and version."""
    out = str(out)
    found = []
    for m in storage.list_dir(out):
        if not m.startswith(MODEL_DIR):
            continue
        for v in storage.list_dir(storage.join(out, m)):
            if v.startswith(VERSION_DIR):
                d = storage.join(out, m, v)
                name, version = unquote(m[len(MODEL_DIR):]), unquote(v[len(VERSION_DIR):])
                found.append(Scores(name, version, d, read_ledger(d)))
    return sorted(found, key=lambda s: (s.model_name, _version_order(s.model_version)))


def _version_order(v: str) -> tuple:
    return (0, int(v), "") if v.isdigit() else (1, 0, v)


def entry_bytes(entry: dict) -> bytes:
    """The entry as it is stored: the same entry gives the same bytes."""
    return json.dumps(entry, sort_keys=True).encode()


def commit(d: str, entry: dict) -> None:
    """Record a unit whose output file is already in place (idempotent: same name, same bytes)."""
    storage.write_bytes(storage.join(d, LEDGER, f"{entry['unit_id']}.json"), entry_bytes(entry))


def forget(d: str, entries: list[dict]) -> None:
    """Drop units: ledger entry first, so a crash leaves an orphan file, never a dangling entry."""
    for e in entries:
        storage.delete(storage.join(d, LEDGER, f"{e['unit_id']}.json"))
    for e in entries:
        storage.delete(storage.join(d, e["output"]))


def discard(s: Scores) -> None:
    """Drop a version's scores whole (--force); its emptied local directories go too, so
    `--status` no longer lists it."""
    forget(s.dir, list(s.entries.values()))
    remove_orphans(s.dir, {})  # interrupted units' files: nothing of this version is kept
    for d in (storage.join(s.dir, LEDGER), s.dir, storage.parent(s.dir)):
        storage.remove_empty_dir(d)


def orphans(d: str, ledger: dict[str, dict]) -> list[str]:
    """Names in a version directory of interrupted units: outputs no entry names, temp files."""
    named = {e["output"] for e in ledger.values()}
    return [n for n in storage.list_dir(d) if n.startswith(f".{PREFIX}") or (n.startswith(PREFIX) and n not in named)]


def remove_orphans(d: str, ledger: dict[str, dict]) -> None:
    """Output and temp files of interrupted units (only ever our own names)."""
    for n in orphans(d, ledger):
        storage.delete(storage.join(d, n))
    for n in storage.list_dir(storage.join(d, LEDGER)):
        if n.startswith("."):
            storage.delete(storage.join(d, LEDGER, n))


def output_lease(out) -> Lease:
    """The output's lease: one scoring job writes here at a time; a second is refused at
    once naming the holder; a dead holder's lease is taken over (foundation.lease)."""
    return Lease(storage.join(str(out), LEASE_NAME), "shardline score", what="scoring output")
