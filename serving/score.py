"""Batch scoring, engine-neutral: plan (read-only, no engine), lock the output, fan units out.

Exactly once per unit and model version: each input file is scored into one output
file whose name depends only on the file and the version's directory, then recorded
in that version's ledger. A retried task rewrites the same name; a re-run after a
crash scores only the units the ledger does not hold. Each model version has its own
directory, so promoting a new version never touches an earlier version's scores.

`plan` does every check and decides what to score without starting an engine or
writing anything: a run with nothing to score ends there (the CLI exits 0 at once).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Literal

from shardline.foundation import storage
from shardline.foundation.errors import DataError, ShardlineError, StorageError
from shardline.foundation.lease import Lease
from shardline.foundation.code_travel import snapshot
from shardline.foundation.progress import ProgressListener

from .delta_output import FORMATS, DeltaOutput
from .inputs import Transform, Unit, check_unit, discover
from .key_column import key_column
from .ledger import (
    Scores,
    all_scores,
    check_output_dir,
    discard,
    output_lease,
    output_name,
    read_ledger,
    remove_orphans,
    version_dir,
)
from .models import ResolvedModel, resolve_model
from .worker import UnitTask

Backfill = Literal["all", "new"]


@dataclass
class ScoreResult:
    """What a scoring job did (`shardline.score` returns it; `to_dict` is the CLI's --json)."""

    output_dir: str
    version_dir: str  # this model version's scores: OUTPUT/model=NAME/version=V
    rows: int  # rows scored by this job
    files_scored: int
    files_skipped: int  # already in the ledger for this model version
    files_left: int  # scored by other versions only, left out by --backfill new
    model_uri: str  # as given
    model_name: str
    model_version: str
    engine: str | None  # None: nothing to score, no engine started
    note: str = ""  # why nothing was scored
    discarded: list[str] = field(default_factory=list)  # what force=True removed

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ScorePlan:
    """What a job will do, decided before any engine starts or anything is written."""

    model: ResolvedModel
    tracking_uri: str
    units: list[Unit]
    transform: Transform
    out: str
    dir: str  # this version's directory in `out`
    incremental: bool
    backfill: Backfill
    force: bool
    todo: list[Unit] = field(default_factory=list)
    skipped: list[Unit] = field(default_factory=list)  # scored by this version, unchanged
    left: list[Unit] = field(default_factory=list)  # scored by another version; --backfill new
    discard: list[Scores] = field(default_factory=list)  # what --force removes
    rows: dict[str, int] = field(default_factory=dict)  # unit id -> rows, of checked units
    table: DeltaOutput | None = None  # output_format = "delta": the table the run appends to
    key_column: str = "key"  # the scores' name for the rows' key (serving.key_column), set by select

    def publish(self) -> int:
        """Delta output: append what the ledgers hold and the table lacks (a run with nothing
        to score still finishes an earlier run's append). Rows appended."""
        return self.table.publish(self) if self.table is not None else 0

    def describe_model(self) -> str:
        return f"model {self.model.name} version {self.model.version}"

    def describe_discard(self) -> list[str]:
        return [f"--force discards the scores of {s.describe()}" for s in self.discard]

    def nothing_done(self) -> ScoreResult:
        """The result of a job that found nothing to score (no engine was started)."""
        out = self.table.root if self.table is not None else self.out
        return ScoreResult(storage.display(out), storage.display(self.dir), 0, 0, len(self.skipped),
                           len(self.left), self.model.uri, self.model.name, self.model.version, None,
                           self.nothing_to_do(), self.describe_discard())

    def nothing_to_do(self) -> str:
        why = f"{len(self.skipped)} file(s) already scored by {self.model.name} version {self.model.version}"
        if self.left:
            why += (f"; {len(self.left)} scored by other versions only, left out by --backfill new "
                    f"(--backfill all scores them with this version)")
        return f"nothing to score: {why}"


def plan(
    model_uri: str,
    tracking_uri: str,
    input_path: str,
    output_dir: str,
    *,
    split: str = "test",
    incremental: bool = False,
    backfill: Backfill = "new",
    force: bool = False,
    output_format: str = "parquet",
    allow_pickled: bool = False,
) -> ScorePlan:
    """Resolve the model, list and check the input, read the output's ledgers: read-only.

    incremental: a scheduled run: add units not yet scored to a version's scores that hold
    other inputs' units (without it such an output is refused), and, with backfill "new",
    leave out units other versions of the model already scored (backfill "all" scores
    every one this version lacks). A run that is not incremental scores every unit of its
    input this version lacks: it asked for this model's scores of this input. force:
    discard whatever the output holds (every model and version) and score everything.
    output_format: "delta": `output_dir` is a Delta table's root (serving.delta_output).
    allow_pickled: a pytorch-flavour model may be scored (serving.allow_pickled_models).
    """
    if backfill not in ("all", "new"):
        raise ShardlineError(f"--backfill {backfill!r}: use 'all' or 'new'")
    if output_format not in FORMATS:
        raise ShardlineError(f"serving.output_format {output_format!r}: use {' or '.join(FORMATS)}")
    table = DeltaOutput(storage.resolve(output_dir, "serving.output_dir")) if output_format == "delta" else None
    if table is not None:
        table.check()
    model = resolve_model(model_uri, tracking_uri, allow_pickled)
    units, transform = discover(input_path, split, model, tracking_uri)
    if model.io:  # a loop's model: what it takes and gives travels with the transform to the tasks
        transform = replace(transform, io_json=json.dumps(model.io))
    out = table.scores if table is not None else storage.resolve(output_dir, "serving.output_dir")
    check_output_dir(out)
    p = ScorePlan(model, tracking_uri, units, transform, out, version_dir(out, model.name, model.version),
                  incremental, backfill, force, table=table)
    select(p)
    for u in p.todo:
        p.rows[u.unit_id] = check_unit(u, transform, p.describe_model())
    if not p.skipped and not p.left and not any(p.rows.values()):
        raise DataError(f"{input_path}: input is empty (0 rows)")
    return p


def select(p: ScorePlan) -> None:
    """Decide todo/skipped/left from the output's ledgers as they are now."""
    found = all_scores(p.out)
    mine = [s for s in found if (s.model_name, s.model_version) == (p.model.name, p.model.version)]
    if p.force:
        p.discard, found, mine = found, [], []
    else:
        check_owner(p.out, found, p.model.name)
    p.key_column = key_column(p.transform.spec.key, found, p.table.key_column() if p.table is not None else None)
    ledger = {uid: e for s in mine for uid, e in s.entries.items()}
    wanted = {u.unit_id for u in p.units}
    others = [e for uid, e in ledger.items() if uid not in wanted]
    if others and not p.incremental:
        raise DataError(
            f"{storage.display(p.dir)}: holds scores of {len(others)} input file(s) that are not in this "
            f"input (e.g. {others[0]['unit']}); pass --incremental to add to them or --force to replace them"
        )
    elsewhere = {
        (uid, e["fingerprint"]) for s in found if s not in mine for uid, e in s.entries.items()
    }
    p.todo, p.skipped, p.left = [], [], []
    for u in p.units:
        e = ledger.get(u.unit_id)
        if e and e["fingerprint"] == u.fingerprint:
            p.skipped.append(u)
        elif p.incremental and p.backfill == "new" and not e and (u.unit_id, u.fingerprint) in elsewhere:
            # Only a scheduled run leaves them: an explicit score of a version scores its input.
            p.left.append(u)
        else:
            # A changed file is scored again into the same output name, replacing its old scores.
            p.todo.append(u)


def execute(
    p: ScorePlan,
    engine,
    *,
    batch_size: int = 4096,
    threads_per_task: int = 1,
    lease: Lease | None = None,
    user_code: Sequence[str] = (),
) -> ScoreResult:
    """Run a plan on `engine` (shardline.engines.base.Engine: its listen_address, ship_code and
    run_units). lease: the output's lease (`ledger.output_lease`), already held (the scoring
    job takes it after its checks); else taken here. user_code: folders (or .py files) of the
    user's code the model needs, shipped to the engine's workers (foundation.code_travel)."""
    model = p.model
    # One time for the whole job, so a retried or duplicated task writes the same bytes.
    scored_at = datetime.now(timezone.utc).isoformat()
    with nullcontext(lease) if lease is not None else output_lease(p.out) as held:
        # Again under the lock: another job may have committed since the plan.
        select(p)
        if p.table is not None:
            p.table.before(p)  # the table stops listing what this run replaces, first
        for s in p.discard:
            discard(s)
        for u in p.todo:
            if u.unit_id not in p.rows:
                p.rows[u.unit_id] = check_unit(u, p.transform, p.describe_model())
        remove_orphans(p.dir, read_ledger(p.dir))
        # Units done show on this console as they commit, wherever the tasks run.
        with (
            ProgressListener(engine.listen_address(), drain=False) as listener,
            listener.stage("score", len(p.todo), "units scored") as scored,
        ):
            # The user's code as it is now (one snapshot for the whole job), on the engine's workers.
            code = engine.ship_code(snapshot(user_code)) if p.todo else None
            tasks = _tasks(p, batch_size, threads_per_task, scored_at, code, listener.address, scored.key)
            entries = engine.run_units(tasks) if tasks else []
        held.check()  # say so if another job took the output over while this one stalled
        # Every unit is committed now; a temp file left is an attempt that died mid-unit
        # (a killed worker) and was retried elsewhere. Still under the lock: no job writes.
        remove_orphans(p.dir, read_ledger(p.dir))
        p.publish()  # Delta output: the committed units appended in one transaction
    _check_entries(entries)
    return ScoreResult(
        storage.display(p.table.root if p.table is not None else p.out), storage.display(p.dir),
        sum(e["rows"] for e in entries), len(entries), len(p.skipped), len(p.left), model.uri, model.name,
        model.version, engine.name, discarded=p.describe_discard(),
    )


def _tasks(p: ScorePlan, batch_size: int, threads: int, scored_at: str, code, progress_addr: str,
           progress_key: str) -> list[UnitTask]:
    """One task per unit to score: what a worker needs to score it into its output name."""
    model = p.model
    return [
        UnitTask(
            unit=u,
            output_dir=p.dir,
            output_name=output_name(u.unit_id),
            model_uri=model.pinned_uri,
            allow_pickled=model.pickled,  # the driver allowed it (serving.allow_pickled_models)
            tracking_uri=p.tracking_uri,
            model_name=model.name,
            model_version=model.version,
            transform=p.transform,
            batch_size=batch_size,
            threads=threads,
            scored_at=scored_at,
            progress_addr=progress_addr,
            progress_key=progress_key,
            code=code,
            key_column=p.key_column,
        )
        for u in p.todo
    ]


def _check_entries(entries: list[dict]) -> None:
    """A failed unit as the job's error: a permanent failure first (what failed the others too),
    else the first; the units that did not fail were committed."""
    errors = [e for e in entries if "error" in e]
    if errors:
        done = len(entries) - len(errors)
        permanent = next((e for e in errors if e.get("permanent")), None)
        if permanent:  # a full disk, a read-only mount: the cause of every other unit's failure too
            raise StorageError(f"{permanent['error']} (not retried: trying again cannot fix it; "
                               f"{done} file(s) were scored and committed)")
        raise DataError(f"{errors[0]['error']} ({done} other file(s) were scored and committed)")


def check_owner(out: str, found: list[Scores], name: str) -> None:
    """Versions of one model share an output; another model's scores there are refused."""
    other = next((s for s in found if s.model_name != name), None)
    if other:
        raise DataError(
            f"{storage.display(out)}: holds scores of model {other.model_name} (version "
            f"{other.model_version}), not of {name}; choose another output directory or "
            f"pass --force to discard them"
        )
