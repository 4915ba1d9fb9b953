"""Dropped rows, by key and reason: a small Parquet file beside each dataset version.

With `pipelines.source.on_bad_rows = "drop"` a prepare skips rows it cannot use; a count
alone leaves the user to hunt for them. So each version whose prepare dropped rows gets
`v-<version>/_rejects/rejects.parquet`, named in the manifest (`rejects`), one row per
dropped row: its key (as read, text: a key that does not parse is one of the reasons),
the reason, the column at fault, the file and row it came from, and the value.

It is capped (`CAP` rows; the manifest records the cap and the total dropped): pass 1
keeps each unit's first rejects, at most `per_unit(units)`, so the reports the driver
merges stay small however bad the input; pass 2 keeps each shard's first repeated keys.
The driver sorts them by position (file, then row) and writes the first CAP. The file is
written by the driver from engine-neutral reports: Spark and Dask prepares write the
same bytes.

Reasons: `unparseable` (a value that does not parse as its column's type), `null_key`,
`null_label`, `negative_label`, `unknown_label`, the tensor and image kinds
(`bad_shape`, `bad_dtype`, `out_of_vocab`, `bad_image`, `image_size`) and
`duplicate_key` (a key seen before: its first row is kept).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.foundation import storage
from .rows import BAD_KINDS
from .sources import display

CAP = 10_000
MIN_PER_UNIT = 100
DIR = "_rejects"
FILE = "rejects.parquet"
DUPLICATE = "duplicate_key"
_REASONS = {"bad": "unparseable"}

SCHEMA = pa.schema([
    ("key", pa.string()),
    ("reason", pa.string()),
    ("column", pa.string()),
    ("file", pa.string()),
    ("row", pa.int64()),  # 0-based row of the file (null: an image file, its own row)
    ("value", pa.string()),
])


def per_unit(units: int) -> int:
    """Rejects each unit reports: its share of the cap, so the driver holds about CAP of
    them, but enough that every bad file shows some."""
    return max(MIN_PER_UNIT, CAP // max(1, units))


def unit_rejects(p, raw: pa.Table, where, bad: np.ndarray, key_column: str, room: int,
                 generate_key: bool, plain) -> list[list]:
    """The first `room` rows of `bad` in one parsed batch: [unit, row in unit, key, reason,
    column, file, row of file, value] each (JSON-able; pass 1's report carries them).
    A row bad in several columns is reported once, for its first problem."""
    rows = np.flatnonzero(bad)[: max(0, room)]
    if not len(rows):
        return []
    kinds = [(k, c, m) for (k, c), m in p.problems.items() if k in BAD_KINDS]
    out = []
    for i in rows:
        kind, col = next((k, c) for k, c, m in kinds if m[i])
        key_ok = generate_key or not any(m[i] for k, c, m in kinds if c == key_column and k in ("bad", "null_key"))
        key = int(p.key[i]) if key_ok else raw.column(key_column)[i].as_py()
        value = raw.column(col)[i].as_py() if col in raw.column_names else None
        unit, in_unit = where.locate(int(i))  # pipelines.chunks.Where: the unit of this row
        file, row = (unit.files[in_unit], None) if unit.files else (unit.url, unit.first_row + in_unit)
        out.append([unit.index, in_unit, None if key is None else str(key), _REASONS.get(kind, kind), col,
                    file, row, _text(value, plain)])
    return out


def repeat_rejects(keys: np.ndarray, pos: np.ndarray) -> str | None:
    """Pass 2's repeated keys of one shard, dropped (their positions >= 0), the first CAP by
    position, as JSON [[key, position], ...] for the shard's metadata row."""
    if not len(keys):
        return None
    order = np.argsort(pos, kind="stable")[:CAP]
    return json.dumps([[int(keys[i]), int(pos[i])] for i in order])


def collect(reported: list[list], metas: list[dict], units: list, key_column: str) -> list[list]:
    """Every reject found, in position order (unit, then row), the first CAP."""
    found = list(reported)
    for m in metas:
        for key, pos in json.loads(m.get("rejects") or "[]"):
            u = units[pos >> 32]
            in_unit = pos & 0xFFFFFFFF
            file, row = (u.files[in_unit], None) if u.files else (u.url, u.first_row + in_unit)
            found.append([u.index, in_unit, str(key), DUPLICATE, key_column, file, row, str(key)])
    found.sort(key=lambda r: (r[0], r[1]))
    return found[:CAP]


def write(version_dir: str, rejects: list[list]) -> str | None:
    """Write the rejects file into the version directory; its path relative to it, or None
    when nothing was dropped."""
    if not rejects:
        return None
    columns = list(zip(*[r[2:] for r in rejects]))
    columns[3] = [display(f) for f in columns[3]]
    table = pa.table([pa.array(list(c), f.type) for c, f in zip(columns, SCHEMA)], schema=SCHEMA)
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, compression="snappy")
    rel = f"{DIR}/{FILE}"
    storage.write_bytes(storage.join(version_dir, DIR, FILE), buf.getvalue().to_pybytes())
    return rel


def _text(value, plain) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return str(plain(value))[:200]
