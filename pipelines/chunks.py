"""Units read as chunks of rows: small units joined, so a task parses ~CHUNK_ROWS rows at once.

Parsing a table costs ~50 Arrow and numpy calls whatever its rows (~2 ms here): on a file
of 1,000 rows that is as much as the rows themselves. A task given many small units
(pipelines.unit_groups) reads them whole and joins consecutive ones of the same columns
into one table of up to CHUNK_ROWS rows; a unit bigger than that streams its batches as
before. Each chunk carries `Where`: which unit, and which row of it, each of its rows is,
so positions, first problems and rejects name files and rows exactly as one unit at a
time would.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from shardline.foundation import storage

from .raw import Unit, first_line, read_unit
from .sources import display

CHUNK_ROWS = 1 << 16
CHUNK_BYTES = 16 << 20  # ...or this many raw bytes: wide rows join fewer at a time


@dataclass(frozen=True)
class Where:
    """The units of a chunk's rows: unit k's rows start at chunk row starts[k] and are its
    rows offsets[k], offsets[k] + 1, ..."""

    units: tuple[Unit, ...]
    starts: tuple[int, ...]
    offsets: tuple[int, ...]

    def locate(self, i: int) -> tuple[Unit, int]:
        """The unit of chunk row `i` and its row in that unit."""
        k = int(np.searchsorted(self.starts, i, "right")) - 1
        return self.units[k], self.offsets[k] + i - self.starts[k]

    def positions(self, rows: np.ndarray) -> np.ndarray:
        """unit index << 32 | row in unit, of chunk rows `rows` (the shuffle's order)."""
        k = np.searchsorted(np.asarray(self.starts), rows, "right") - 1
        index = np.array([u.index for u in self.units], np.int64)[k]
        return (index << 32) | (np.asarray(self.offsets, np.int64)[k] + rows - np.asarray(self.starts, np.int64)[k])

    @property
    def single(self) -> Unit | None:
        return self.units[0] if len(self.units) == 1 else None

    @property
    def base(self) -> Unit | None:
        """A unit of the chunk's one folder (read_chunks never mixes folders): what relative
        image paths in its rows are relative to."""
        return self.units[0] if self.units else None


@dataclass(frozen=True)
class Unreadable:
    """A unit that could not be read: its one line (pass 1 reports it in unit order)."""

    unit: Unit
    error: str


def read_chunks(units: tuple[Unit, ...] | list[Unit], columns: list[str], delimiter: str,
                chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[pa.Table, Where] | Unreadable]:
    """The units' rows in unit and row order, as (table, Where) chunks; an unreadable unit
    as Unreadable in its place (the units before it are yielded first)."""
    pending: list[tuple[pa.Table, Unit]] = []
    held = held_bytes = 0

    def flush():
        nonlocal pending, held, held_bytes
        if pending:
            starts = tuple(int(s) for s in np.cumsum([0] + [t.num_rows for t, _ in pending[:-1]]))
            table = pending[0][0] if len(pending) == 1 else pa.concat_tables([t for t, _ in pending])
            yield table, Where(tuple(u for _, u in pending), starts, (0,) * len(pending))
        pending, held, held_bytes = [], 0, 0

    for unit in units:
        if unit.rows >= chunk_rows or unit.bytes >= CHUNK_BYTES or unit.files:  # big (or images): streamed
            yield from flush()
            offset = 0
            try:
                for t in read_unit(unit, columns, delimiter):
                    yield t, Where((unit,), (0,), (offset,))
                    offset += t.num_rows
            except Exception as e:  # the file's fault, reported in order
                yield Unreadable(unit, unreadable(unit, e))
            continue
        try:
            tables = list(read_unit(unit, columns, delimiter))
        except Exception as e:
            yield from flush()
            yield Unreadable(unit, unreadable(unit, e))
            continue
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        full = held + table.num_rows > chunk_rows or held_bytes + unit.bytes > CHUNK_BYTES
        # One folder a chunk: a relative image path in a row is its file's folder's (Where.base).
        elsewhere = bool(pending) and storage.parent(unit.url) != storage.parent(pending[0][1].url)
        if pending and (full or elsewhere or not table.schema.equals(pending[0][0].schema)):
            yield from flush()
        pending.append((table, unit))
        held += table.num_rows
        held_bytes += unit.bytes
    yield from flush()


def unreadable(unit: Unit, e: BaseException) -> str:
    return f"{display(unit.url)}: not readable {unit.fmt} ({first_line(e)})"
