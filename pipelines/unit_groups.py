"""Units dealt into tasks: many small files share one task, a big unit keeps its own.

A unit is one file (CSV, JSON) or a run of a Parquet file's row groups. Data that
arrives as 100,000 files of 1,000 rows would be 100,000 engine tasks, each paying a
task's fixed cost (scheduling, a Python worker's round trip, a result to the driver:
milliseconds, against the ~1 ms its 1,000 rows take to parse) and leaving the driver
100,000 results to hold. So consecutive units are grouped until a group holds about
GROUP_ROWS rows: a task then costs what a unit of a few big files costs. Units keep
their own index, so positions, first errors and reports are the same as one task per
unit, and progress still counts units.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shardline.foundation.progress import tick

from .raw import Unit

# Rows a task reads before it is worth its fixed cost many times over: ~0.3-1 s of
# parsing on one core, against ~10-20 ms per Spark or Dask task on this machine; or
# bytes (wide rows), whichever comes first.
GROUP_ROWS = 1 << 18
GROUP_BYTES = 32 << 20
# Units in a group whose rows are unknown (0) or tiny still end a group here: a task's
# result and its list of units stay small.
GROUP_UNITS = 4096


@dataclass(frozen=True)
class UnitGroup:
    """Consecutive units read by one task, in unit order."""

    units: tuple[Unit, ...]


def group_units(units: list[Unit], rows: int = GROUP_ROWS, most: int = GROUP_UNITS) -> list[UnitGroup]:
    """`units` cut into consecutive groups of about `rows` rows or GROUP_BYTES bytes (a unit
    of that many or more alone), at most `most` units each. Pure: the same units, the same
    groups."""
    groups: list[UnitGroup] = []
    current: list[Unit] = []
    held = held_bytes = 0
    for u in units:
        full = held + u.rows > rows or held_bytes + u.bytes > GROUP_BYTES or len(current) >= most
        # An images unit is already a task's worth of decoding (pipelines.images.UNIT_FILES).
        if current and (full or u.files or current[-1].files):
            groups.append(UnitGroup(tuple(current)))
            current, held, held_bytes = [], 0, 0
        current.append(u)
        held += u.rows
        held_bytes += u.bytes
    if current:
        groups.append(UnitGroup(tuple(current)))
    return groups


def report_group(group: UnitGroup, task, cap: int) -> dict:
    """Pass 1 of a group (tasks.report_units): the first `cap` rejects kept (the driver
    keeps only the first `cap` of all, in the same order)."""
    from .tasks import report_units

    merged = report_units(group.units, task)
    merged["rejects"] = merged["rejects"][:cap]
    return merged


def group_rows(source, task, stats, parts, existing: Callable) -> Iterator:
    """Pass 2 of a source: a group's rows (tasks.shuffle_units), or `existing(source)`'s
    (an existing shard's keys, on an append)."""
    from .tasks import shuffle_units

    if isinstance(source, UnitGroup):
        yield from shuffle_units(source.units, task, stats, parts)
    else:
        yield from existing(source)


@dataclass(frozen=True)
class CountedUnits:
    """fn(source), ticking the driver's stage once per unit of a group (once for any other
    source) when it is done (a generator: once exhausted): progress counts units, as before
    units were grouped. Picklable when fn is."""

    fn: Callable
    address: str | None
    key: str | None

    def __call__(self, source):
        out = self.fn(source)
        if inspect.isgenerator(out):
            return self._after(out, source)
        self._tick(source)
        return out

    def _after(self, gen, source):
        yield from gen
        self._tick(source)

    def _tick(self, source) -> None:
        for _ in range(len(source.units) if isinstance(source, UnitGroup) else 1):
            tick(self.address, self.key)
