"""Batch scoring, engine-neutral: check everything, lock the output, fan units out, tally.

Exactly once per unit: each input file is scored into one output file whose name
depends only on the file and the model, then recorded in the ledger. A retried
task rewrites the same name; a re-run after a crash scores only the units the
ledger does not hold. An output directory holds one model version's scores.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone

from pipelines import storage
from pipelines.errors import DataError, ShardlineError
from pipelines.lease import Lease

from .inputs import check_unit, discover
from .ledger import (
    check_output_dir,
    forget,
    output_lease,
    output_name,
    read_ledger,
    remove_orphans,
)
from .models import resolve_model
from .worker import UnitTask

ENGINES = ("spark", "dask")


@dataclass
class ScoreResult:
    output_dir: str
    rows: int  # rows scored by this job
    files_scored: int
    files_skipped: int  # already in the ledger for this model version
    model_name: str
    model_version: str


def score(
    engine_name: str,
    spark_or_client,
    model_uri: str,
    tracking_uri: str,
    input_path: str,
    output_dir: str,
    *,
    split: str = "test",
    incremental: bool = False,
    force: bool = False,
    batch_size: int = 4096,
    threads_per_task: int = 1,
    lease: Lease | None = None,
) -> ScoreResult:
    """Score `input_path` (a prepared dataset's `split`, or raw Parquet) into `output_dir`.

    incremental: add units not yet scored to an output that holds scores of other
    inputs; without it such an output is refused. force: discard whatever the
    output holds (another model's scores included) and score everything.
    lease: the output's lease (`ledger.output_lease`), already held (the CLI takes it
    before an engine starts); else taken here, after the checks.
    """
    if engine_name not in ENGINES:
        raise ShardlineError(f"unknown engine '{engine_name}' (valid: {', '.join(ENGINES)})")
    model = resolve_model(model_uri, tracking_uri)
    units, transform = discover(input_path, split, model, tracking_uri)
    out = storage.resolve(output_dir, "serving.output_dir")
    check_output_dir(out)
    # Everything checkable is checked before the first write, lock file included.
    ledger = {} if force else read_ledger(out)
    _check_owner(out, ledger, model, force)
    todo, skipped = _plan(out, units, ledger, incremental)
    rows = {u.unit_id: check_unit(u, transform) for u in todo}
    if not skipped and not any(rows.values()):
        raise DataError(f"{input_path}: input is empty (0 rows)")

    # One time for the whole job, so a retried or duplicated task writes the same bytes.
    scored_at = datetime.now(timezone.utc).isoformat()
    with nullcontext(lease) if lease is not None else output_lease(out) as held:
        # Again under the lock: another job may have committed since.
        ledger = read_ledger(out)
        _check_owner(out, ledger, model, force)
        if force:
            forget(out, list(ledger.values()))
            ledger = {}
        todo, skipped = _plan(out, units, ledger, incremental)
        for u in todo:
            if u.unit_id not in rows:
                rows[u.unit_id] = check_unit(u, transform)
        remove_orphans(out, ledger)
        tasks = [
            UnitTask(
                unit=u,
                output_dir=out,
                output_name=output_name(u.unit_id, model.name, model.version),
                model_uri=model.pinned_uri,
                tracking_uri=tracking_uri,
                model_name=model.name,
                model_version=model.version,
                transform=transform,
                batch_size=batch_size,
                threads=threads_per_task,
                scored_at=scored_at,
            )
            for u in todo
        ]
        entries = _run(engine_name, spark_or_client, tasks) if tasks else []
        held.check()  # say so if another job took the output over while this one stalled
        # Every unit is committed now; a temp file left is an attempt that died mid-unit
        # (a killed worker) and was retried elsewhere. Still under the lock: no job writes.
        remove_orphans(out, read_ledger(out))
    errors = [e for e in entries if "error" in e]
    if errors:
        done = len(entries) - len(errors)
        raise DataError(f"{errors[0]['error']} ({done} other file(s) were scored and committed)")
    return ScoreResult(
        storage.display(out),
        sum(e["rows"] for e in entries),
        len(entries),
        len(skipped),
        model.name,
        model.version,
    )


def _check_owner(out: str, ledger: dict[str, dict], model, force: bool) -> None:
    other = next(
        (e for e in ledger.values() if (e["model_name"], e["model_version"]) != (model.name, model.version)),
        None,
    )
    if other and not force:
        raise DataError(
            f"{storage.display(out)}: holds scores of model {other['model_name']} version "
            f"{other['model_version']}, not {model.name} version {model.version}; "
            f"choose another output directory or pass --force to replace them"
        )


def _plan(out: str, units, ledger: dict[str, dict], incremental: bool):
    """(units to score, units already committed unchanged)."""
    wanted = {u.unit_id for u in units}
    others = [e for uid, e in ledger.items() if uid not in wanted]
    if others and not incremental:
        raise DataError(
            f"{storage.display(out)}: holds scores of {len(others)} input file(s) that are not in this input "
            f"(e.g. {others[0]['unit']}); pass --incremental to add to them or --force to replace them"
        )
    todo, skipped = [], []
    for u in units:
        e = ledger.get(u.unit_id)
        # A changed file is scored again into the same output name, replacing its old scores.
        (skipped if e and e["fingerprint"] == u.fingerprint else todo).append(u)
    return todo, skipped


def _run(engine_name: str, spark_or_client, tasks: list[UnitTask]) -> list[dict]:
    if engine_name == "spark":
        from .engine_spark import run_units
    else:
        from .engine_dask import run_units
    return run_units(spark_or_client, tasks)
