"""One data file of a Delta or Iceberg table, read as the table's rows (inside a task).

The driver decides, per file, how its columns become the table's (pipelines.tables);
the task only applies that: no task opens the table's log or catalog. Kept apart from
tables.py so that tasks import pyarrow alone, not deltalake or pyiceberg.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

CHANGE_TYPE = "_change_type"  # Delta's change data files: insert, delete, update_preimage, update_postimage


@dataclass(frozen=True)
class TableFile:
    """How one data file reads as rows of its table at the pinned version."""

    schema: pa.Schema  # the table's at that version: every file's rows are conformed to it
    # (table column, column in the file) where the file names it otherwise (Iceberg: found by
    # its field id, so a renamed column is read from its old name).
    renames: tuple[tuple[str, str], ...] = ()
    # Delta's partition values: kept in the log, not in the file; (column, value).
    constants: tuple[tuple[str, object], ...] = ()
    # A Delta change-data file: only its rows of this change type are the table's new rows.
    change_type: str | None = None

    def file_column(self, column: str) -> str:
        return dict(self.renames).get(column, column)

    def file_columns(self, columns: list[str], in_file: list[str]) -> list[str]:
        """The file's columns to read for `columns` of the table (absent ones are filled)."""
        constant = dict(self.constants)
        wanted = [self.file_column(c) for c in columns if c not in constant]
        if self.change_type is not None:
            wanted.append(CHANGE_TYPE)
        return [c for c in dict.fromkeys(wanted) if c in in_file]

    def conform(self, table: pa.Table, columns: list[str]) -> pa.Table:
        """`table` (read from the file) as the table's `columns`: renamed, cast to the table's
        types (a widened or promoted column), partition values filled in, columns the file
        predates as nulls, and a change-data file's other change types left out."""
        table = _without_views(table)
        if self.change_type is not None:
            table = table.filter(pc.equal(table.column(CHANGE_TYPE), self.change_type))
        n = table.num_rows
        constant = dict(self.constants)
        out = {}
        for c in columns:
            if c not in self.schema.names:
                continue  # not in the table either: the column checks name it
            kind = self.schema.field(c).type
            if c in constant:
                out[c] = pa.array([constant[c]] * n, kind)
            elif self.file_column(c) in table.column_names:
                col = table.column(self.file_column(c))
                out[c] = col if col.type == kind else col.cast(kind)
            else:
                out[c] = pa.nulls(n, kind)
        return pa.table(out) if out else table.select([])


def _without_views(table: pa.Table) -> pa.Table:
    """String and binary views as plain strings and binaries (delta-rs writes views in its
    change-data files; pyarrow's filter has no kernel for them)."""
    for i, f in enumerate(table.schema):
        if pa.types.is_string_view(f.type):
            table = table.set_column(i, f.name, table.column(i).cast(pa.string()))
        elif pa.types.is_binary_view(f.type):
            table = table.set_column(i, f.name, table.column(i).cast(pa.binary()))
    return table
