"""`shardline score --status OUTPUT`: per model version, what is scored and what is pending.

Read-only and engine-free: it reads the ledgers (and, given an input, lists its
units) and nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shardline.foundation import storage
from shardline.foundation.lease import LEASE_NAME, Lease

from .delta_output import scores_of
from .inputs import Unit
from .ledger import all_scores, orphans


@dataclass
class VersionStatus:
    model_name: str
    model_version: str
    dir: str
    units: int
    rows: int
    last_scored_at: str
    pending: int | None  # units (of the input, else of the output) this version has not scored
    interrupted: int  # output files of units that never committed (the next run replaces them)


@dataclass
class OutputStatus:
    output_dir: str
    versions: list[VersionStatus]
    new_units: int | None  # input units no version has scored (None without an input)
    holder: str | None  # the job writing here now, if any
    stale: str | None = None  # a dead job's lease left here: why it is dead (the next run takes it over)


def output_status(output_dir: str, units: list[Unit] | None = None) -> OutputStatus:
    out = scores_of(storage.resolve(output_dir, "--status"))  # a Delta output: its scores folder
    found = all_scores(out)
    scored = {(uid, e["fingerprint"]) for s in found for uid, e in s.entries.items()}
    if units is None:
        universe = scored  # every unit some version scored
        new = None
    else:
        universe = {(u.unit_id, u.fingerprint) for u in units}
        new = len(universe - scored)
    rows = []
    for s in found:
        mine = {(uid, e["fingerprint"]) for uid, e in s.entries.items()}
        rows.append(_row(s, len(universe - mine)))
    holder = Lease.holder(storage.join(out, LEASE_NAME))
    # The same judgement the next run makes before it takes the lease over.
    stale = holder.stale(time.time()) if holder else None
    return OutputStatus(storage.display(out), rows, new, holder.describe() if holder else None, stale)


def _row(s, pending: int) -> VersionStatus:
    entries = list(s.entries.values())
    return VersionStatus(
        s.model_name, s.model_version, storage.display(s.dir), len(entries), sum(e["rows"] for e in entries),
        max((e["scored_at"] for e in entries), default=""), pending, len(orphans(s.dir, s.entries)),
    )
