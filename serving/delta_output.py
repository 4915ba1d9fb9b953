"""Scores into a Delta Lake table (`serving.output_format = "delta"`), exactly once.

The table's root is `serving.output_dir`. Scoring runs exactly as for Parquet output, in
the table's hidden folder `_shardline_scores/` (names starting with `_` are no data files
to Delta readers and VACUUM leaves them alone): each unit's file, its ledger entry (the
unit's commit), the output's lease. Then the driver appends the run's committed files to
the table in ONE Delta transaction (add actions naming the files where they are: no row
is copied), carrying Delta's idempotent-write transaction id: the application id
`shardline-score <model> <version>` and a version one above the table's last for it.
A commit retried after an unclear failure is a no-op once the table holds that id. The
table's first commit (version 0) is written by shardline and published in one step
(serving.delta_create): a run stopped before it leaves no `_delta_log/` behind.

The ledger says what is scored, the table says what is published: a file the ledger
holds and the table does not list (a job killed between the two commits) is appended by
the next run, whether it has units to score or not; nothing is listed twice, because the
table's live files are read before each commit. Files the table lists that a run is about
to replace (--force, or an input file that changed) are removed from the table first, in
a transaction of their own, so a reader never meets a listed file that is being rewritten.
Writing on S3 relies on the output's lease for a single writer (delta-rs is told to
commit without a lock: AWS_S3_ALLOW_UNSAFE_RENAME).
"""

from __future__ import annotations

import json
import time
from urllib.parse import unquote

import pyarrow as pa

from shardline.foundation import storage
from shardline.pipelines.delta_source import is_table, native, storage_options
from shardline.foundation.errors import ConfigError, DataError, first_line

from .ledger import all_scores, read_ledger

from .worker import output_schema

# Imported inside the functions that use them: deltalake (only for a Delta table).
from .delta_create import LOG, first_commit, has_commits, is_staging, publish_first

SCORES = "_shardline_scores"
FORMATS = ("parquet", "delta")


def scores_dir(output_dir: str, output_format: str = "parquet") -> str:
    """Where a run's scores and ledgers live: the output itself, or a Delta table's hidden folder."""
    return storage.join(output_dir, SCORES) if output_format == "delta" else output_dir


def scores_of(out: str) -> str:
    """An output as `score --status` reads it: a Delta output's hidden folder, else itself."""
    inner = storage.join(out, SCORES)
    return inner if storage.is_dir(inner) else out


def app_id(model_name: str, model_version: str) -> str:
    return f"shardline-score {model_name} {model_version}"


class DeltaOutput:
    """The Delta table a scoring run appends to, and the hidden folder its scores live in."""

    def __init__(self, root: str):
        self.root = root
        self.scores = storage.join(root, SCORES)

    def check(self) -> None:
        """The root is absent, empty, or a Delta table: refused in one line otherwise."""
        found = [n for n in storage.list_dir(self.root) if n != SCORES and not is_staging(n)]
        if found and not is_table(self.root):
            raise ConfigError(f"serving.output_dir = {storage.display(self.root)}: holds files ({found[0]}, ...) "
                              "and is not a Delta table; choose an empty folder or a Delta table for output_format "
                              "= 'delta'")

    # -- the table's side -------------------------------------------------------------------

    def _table(self):
        from deltalake import DeltaTable

        # A _delta_log/ with no commit in it (a create stopped midway, before shardline wrote
        # version 0 itself) is no table yet: the first commit clears it (serving.delta_create).
        return DeltaTable(native(self.root), storage_options=storage_options(self.root)) \
            if is_table(self.root) and has_commits(self.root) else None

    def key_column(self) -> str | None:
        """The table's key column (its first: serving.worker.output_schema), if it exists."""
        table = self._table()
        return table.schema().fields[0].name if table is not None else None

    def _live(self, table) -> set[str]:
        if table is None:
            return set()
        return {unquote(p) for p in pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist()}

    def _rel(self, d: str, output: str) -> str:
        return storage.join(d, output)[len(self.root.rstrip("/")) + 1:]

    def before(self, plan) -> None:
        """Remove from the table the files this run replaces (--force's discards, a changed
        input's unit scored again), in a transaction of their own, before they are touched."""
        table = self._table()
        if table is None:
            return
        live = self._live(table)
        gone = [self._rel(s.dir, e["output"]) for s in plan.discard for e in s.entries.values()]
        ledger = read_ledger(plan.dir)
        gone += [self._rel(plan.dir, ledger[u.unit_id]["output"]) for u in plan.todo if u.unit_id in ledger]
        gone = sorted({g for g in gone if g in live})
        if gone:
            from deltalake.transaction import RemoveAction

            now = int(time.time() * 1000)
            self._commit(table, [RemoveAction(g, True, now) for g in gone], plan, "remove")

    def publish(self, plan) -> int:
        """Append every committed score file the table does not list yet: one transaction.
        Rows appended."""
        from deltalake.transaction import AddAction

        table = self._table()
        live = self._live(table)
        adds = []
        for s in all_scores(self.scores):
            for e in sorted(s.entries.values(), key=lambda e: e["output"]):
                rel = self._rel(s.dir, e["output"])
                if rel not in live:
                    adds.append({"path": rel, "size": storage.size(storage.join(s.dir, e["output"])),
                                 "rows": e["rows"]})
        if not adds:
            return 0
        spec = plan.transform.spec
        schema = output_schema(spec.task == "classification", spec.task == "next_token", plan.key_column,
                               plan.transform.io.get("output") == "tensor")
        if table is None:
            self._create(adds, plan, schema)
        else:
            now = int(time.time() * 1000)
            self._commit(table, [AddAction(a["path"], a["size"], {}, now, True, json.dumps({"numRecords": a["rows"]}))
                                 for a in adds], plan, "append", schema)
        return sum(a["rows"] for a in adds)

    def _create(self, adds: list[dict], plan, schema: pa.Schema) -> None:
        """Version 0, holding this run's appends: published whole (serving.delta_create)."""
        app = app_id(plan.model.name, plan.model.version)
        data = first_commit(schema, adds, app, 1, "append")
        try:
            if publish_first(self.root, data):
                return
        except Exception as e:
            raise DataError(f"serving.output_dir = {storage.display(self.root)}: the Delta table could not be "
                            f"created ({first_line(e, 200)}); nothing of it was written, the scores are committed in "
                            f"{SCORES}/ and the next run appends them") from None
        table = self._table()  # someone created it first
        if table is None:
            raise DataError(f"serving.output_dir = {storage.display(self.root)}: its {LOG}/ changed while the "
                            "table was created; run again")
        if (table.transaction_version(app) or 0) < 1:  # not ours: append to it as to any table
            self.publish(plan)

    def _commit(self, table, actions: list, plan, what: str, schema: pa.Schema | None = None) -> None:
        """One Delta transaction on an existing table with the run's transaction id; retried,
        it lands once."""
        from deltalake import CommitProperties, Transaction

        app = app_id(plan.model.name, plan.model.version)
        version = (table.transaction_version(app) or 0) + 1
        props = CommitProperties(app_transactions=[Transaction(app, version)],
                                 custom_metadata={"shardline": f"score {what}"})
        for attempt in range(3):
            try:
                table.create_write_transaction(actions, "append", schema or table.schema(), commit_properties=props)
                return
            except Exception as e:
                table = self._table()
                if table is not None and (table.transaction_version(app) or 0) >= version:
                    return  # the commit landed before its answer was lost: nothing more to do
                if attempt == 2 or _permanent(e):
                    raise DataError(f"serving.output_dir = {storage.display(self.root)}: the Delta commit failed "
                                    f"({first_line(e, 200)}); the scores are committed in {SCORES}/ and the next run "
                                    "appends them") from None
                time.sleep(0.5 * (attempt + 1))


def _permanent(e: Exception) -> bool:
    text = str(e).lower()
    return "schema" in text or "permission" in text
