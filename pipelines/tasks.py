"""What one task does, on either engine: report a unit (pass 1), turn it into shuffle rows (pass 2).

Pass 1 reads a unit and returns a small JSON report: rows per split, the first
example of every problem, train-split moments and category counts. The driver
merges the reports in unit order (`merge_reports`), so statistics and first
errors depend neither on the engine nor on the order tasks finish in.

Pass 2 reads the unit again, parses it, drops bad rows, applies the transform and
emits the rows shards hold, tagged with their part (split and shard) and their
position (unit, row) for the engine's shuffle. Features travel as one binary value
per row (the row's float32 bytes): cheaper through Spark's and Dask's shuffles than
a list column or a column per float.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import rejects
from shardline.foundation import storage
from .config import FeatureSpec, SplitConfig
from shardline.foundation.errors import DataError
from .manifest import FittedStatistics
from .chunks import Unreadable, Where, read_chunks, unreadable
from .raw import Unit
from .rows import BAD_KINDS, INVALID, Parsed, parse, shard_hash, split_codes
from .splits import SPLITS
from .sources import display
from .tensors import binary_rows
from .transform import feature_width, features


def _payload_bytes(arr: pa.Array) -> int:
    """Bytes of a binary column's values."""
    return pc.sum(pc.binary_length(arr)).as_py() or 0

POS_COL = "_pos"  # unit index << 32 | row in unit; negative for an existing dataset's rows
PART_COL = "_part"  # the shard a row goes to, numbered over splits (see Parts)


@dataclass(frozen=True)
class PrepareTask:
    """What every task of a prepare needs; small, shipped to the tasks."""

    spec: FeatureSpec  # resolved: every column named
    split: SplitConfig
    drop_bad: bool
    num_classes: int | None  # labels at or above are unknown; None infers the classes
    delimiter: str = ","  # of CSV input
    rejects_per_unit: int = 0  # dropped rows each unit reports by key (pipelines.rejects)

    @property
    def columns(self) -> list[str]:
        s = self.spec
        label = [s.label] if s.task != "next_token" else []  # next_token: the label is a tensor column
        cols = [*label, *s.numeric, *s.categorical, *s.vectors, *s.tensors, *s.images]
        return cols if s.generate_key else [s.key, *cols]

    def parse(self, table: pa.Table, unit: Unit | None = None) -> Parsed:
        base = storage.parent(unit.url) if unit is not None and unit.fmt != "images" else None
        return parse(table, self.spec, self.split, self.num_classes, base)


@dataclass(frozen=True)
class Parts:
    """Shard counts per split; part p numbers (split, shard) over all splits, train first."""

    counts: tuple[int, int, int]  # train, val, test

    @property
    def total(self) -> int:
        return sum(self.counts)

    def of(self, split_codes: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        offsets = np.cumsum((0, *self.counts[:-1]))
        counts = np.maximum(np.array(self.counts, np.int64), 1)  # a split with no shards has no rows
        return (offsets[split_codes] + hashes % counts[split_codes]).astype(np.int32)

    def split_shard(self, part: int) -> tuple[str, int]:
        for s, n in zip(SPLITS, self.counts):
            if part < n:
                return s, part
            part -= n
        raise ValueError(f"part {part} out of range")


# -- pass 1: report --------------------------------------------------------------------


def report_unit(unit: Unit, task: PrepareTask) -> dict:
    """Counts, first problems and train statistics of one unit (JSON-able)."""
    return report_units([unit], task)


def report_units(units: list[Unit] | tuple[Unit, ...], task: PrepareTask) -> dict:
    """report_unit of consecutive units, merged in unit order; small units are parsed
    together (pipelines.chunks), with the same figures and first problems."""
    rep = _empty_report()
    seen: set[int] = set()  # units met so far: each brings rejects_per_unit to the room for rejects
    for chunk in read_chunks(units, task.columns, task.delimiter):
        if isinstance(chunk, Unreadable):  # the file's fault (unreadable, malformed), reported in order
            rep.setdefault("error", chunk.error)
            continue
        for parsed in _parsed(*chunk, task):
            if isinstance(parsed, Unreadable):
                rep.setdefault("error", parsed.error)
                continue
            p, table, where = parsed
            seen.update(u.index for u in where.units)
            room = task.rejects_per_unit * len(seen) - len(rep["rejects"])
            _merge(rep, _report_batch(p, table, where, task, room))
    return rep


def _parsed(table: pa.Table, where: Where, task: PrepareTask):
    """(parsed, table, where) of a chunk; when parsing it fails (a value of a type the row
    code cannot take), each of its units alone, the failing one as Unreadable."""
    try:
        p = task.parse(table, where.base)
    except Exception as e:
        if where.single is not None:
            yield Unreadable(where.single, unreadable(where.single, e))
            return
    else:
        yield p, table, where
        return
    ends = (*where.starts[1:], table.num_rows)
    for unit, start, end, offset in zip(where.units, where.starts, ends, where.offsets):
        yield from _parsed(table.slice(start, end - start), Where((unit,), (0,), (offset,)), task)


def _report_batch(p: Parsed, raw: pa.Table, where: Where, task: PrepareTask, room: int = 0) -> dict:
    spec = task.spec
    bad = p.mask(BAD_KINDS)
    keep = ~bad if task.drop_bad else np.ones(p.n, bool)
    rep = _empty_report()
    rep["rows"] = [int(((p.split == i) & keep).sum()) for i in range(3)]
    rep["dropped"] = int(bad.sum()) if task.drop_bad else 0
    if task.drop_bad:
        rep["rejects"] = rejects.unit_rejects(p, raw, where, bad, spec.key, room, spec.generate_key, _plain)
    # Rows the settings make fatal, each once however many columns or kinds it fails:
    # the count the first problem's one line gives (a per-column count undercounts).
    fatal = (np.zeros(p.n, bool) if task.drop_bad else bad.copy())
    if spec.on_invalid_features == "fail":
        fatal |= p.mask((INVALID,)) & keep
    rep["fatal_rows"] = int(fatal.sum())
    for (kind, col), mask in p.problems.items():
        # Rows dropped as bad are reported as such, not again as invalid.
        mask = mask if kind in BAD_KINDS else mask & keep
        if not mask.any():
            continue
        i = int(np.argmax(mask))
        unit, in_unit = where.locate(i)
        # The key as parsed when it parses (JSON and CSV keys are text), else as written.
        key_ok = spec.generate_key or not any(
            p.problems.get((k, spec.key), np.zeros(p.n, bool))[i] for k in ("bad", "null_key")
        )
        key = int(p.key[i]) if key_ok else raw.column(spec.key)[i].as_py()
        value = raw.column(col)[i].as_py()
        rep["problems"].setdefault(kind, {})[col] = {
            "count": int(mask.sum()),
            "at": [unit.index, in_unit],
            # The images source: the image file itself, not its folder.
            "file": unit.files[in_unit] if unit.files else unit.url,
            "key": _plain(key),
            "value": f"<{len(value)} bytes>" if isinstance(value, bytes) else _plain(value),
        }
    # Bytes of images per row vary: shard counts are sized by what prepare saw.
    rep["payload"] = sum(int(_payload_bytes(a.filter(pa.array(keep)))) for a in p.images.values())
    labels = p.label[keep & (p.label >= 0)] if spec.task == "classification" else np.array([])
    if len(labels):
        rep["label_max"] = int(labels.max())
    train = keep & (p.split == 0)
    for c in spec.numeric:
        x = p.numeric[c][train]
        rep["moments"][c] = _moments(x[np.isfinite(x)])
    if spec.task == "regression":
        # The label's scale, fitted on train like the features': training standardises it.
        y = p.label[train].astype(np.float64)
        rep["label_moments"] = _moments(y[np.isfinite(y)])
    if spec.categorical_encoding == "index":
        for c in spec.categorical:
            codes, values = p.categorical[c]
            counts = np.bincount(codes[train & (codes >= 0)], minlength=len(values))
            rep["categories"][c] = {values[i]: int(counts[i]) for i in np.flatnonzero(counts)}
    return rep


def _empty_report() -> dict:
    return {"rows": [0, 0, 0], "dropped": 0, "fatal_rows": 0, "payload": 0, "problems": {}, "moments": {},
            "categories": {}, "rejects": []}


def merge_reports(reports: list[dict]) -> dict:
    """Reports merged in list order (unit order): the result does not depend on the engine."""
    out = _empty_report()
    for r in reports:
        _merge(out, r)
    return out


def _merge(out: dict, r: dict) -> None:
    """Fold report `r` (later in unit/row order) into `out`: sums, the earliest example
    of each problem, Chan's parallel merge of moments."""
    if "error" in r and "error" not in out:
        out["error"] = r["error"]
    out["rows"] = [a + b for a, b in zip(out["rows"], r["rows"])]
    out["dropped"] += r["dropped"]
    out["rejects"] += r.get("rejects", [])
    out["fatal_rows"] += r.get("fatal_rows", 0)
    out["payload"] += r["payload"]
    for kind, by_col in r["problems"].items():
        for col, p in by_col.items():
            have = out["problems"].setdefault(kind, {}).get(col)
            if have is None:
                out["problems"][kind][col] = dict(p)
            else:
                have["count"] += p["count"]
    if "label_max" in r:
        out["label_max"] = max(out.get("label_max", r["label_max"]), r["label_max"])
    for c, moments in r["moments"].items():
        out["moments"][c] = _merge_moments(out["moments"].get(c), moments)
    if "label_moments" in r:
        out["label_moments"] = _merge_moments(out.get("label_moments"), r["label_moments"])
    for c, counts in r["categories"].items():
        acc = out["categories"].setdefault(c, {})
        for v, n in counts.items():
            acc[v] = acc.get(v, 0) + n


def imputed_values(report: dict, spec: FeatureSpec, earlier: dict[str, int]) -> dict[str, int]:
    """Feature values imputed per column: pass 1 counted them (rows kept, per column) as
    problems of kind INVALID; an append adds the shards kept from before."""
    if spec.on_invalid_features != "impute":
        return dict(earlier)
    out = dict(earlier)
    for col, p in report["problems"].get(INVALID, {}).items():
        out[col] = out.get(col, 0) + int(p["count"])
    return {c: n for c, n in out.items() if n}


def _merge_moments(a, b) -> tuple:
    """(count, mean, sum of squared deviations) of a's rows then b's (Chan et al.)."""
    n0, mean0, m20 = a if a is not None else (0, 0.0, 0.0)
    n, mean, m2 = b
    total = n0 + n
    if not total:
        return (0, 0.0, 0.0)
    delta = mean - mean0
    return (total, mean0 + delta * n / total, m20 + m2 + delta * delta * n0 * n / total)


def first_problem(report: dict, kinds) -> tuple[str, str, dict] | None:
    """The problem of `kinds` met first in unit and row order: (kind, column, example)."""
    found = [
        (tuple(p["at"]), k, col, p)
        for k in kinds
        for col, p in report["problems"].get(k, {}).items()
    ]
    if not found:
        return None
    order = {k: i for i, k in enumerate(kinds)}
    _, kind, col, p = min(found, key=lambda f: (f[0], order[f[1]]))
    return kind, col, p


def _moments(x: np.ndarray) -> list:
    if not len(x):
        return [0, 0.0, 0.0]
    mean = float(x.mean())
    return [int(len(x)), mean, float(((x - mean) ** 2).sum())]


def _plain(v):
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    if isinstance(v, (list, tuple)):
        return str(list(v))[:60]
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)[:60]


# -- pass 2: rows for the shuffle --------------------------------------------------------


def transport_schema(spec: FeatureSpec) -> pa.Schema:
    """The rows pass 2 hands to the shuffle and the shard writer receives."""
    return pa.schema(
        [
            (spec.key, pa.int64()),
            *label_fields(spec),
            ("features", pa.binary()),
            # Tensors (their stored bytes) and encoded images: one binary value a row.
            *((c, pa.binary()) for c in (*spec.tensors, *spec.images)),
            (POS_COL, pa.int64()),
            (PART_COL, pa.int32()),
        ]
    )


def label_fields(spec: FeatureSpec) -> list[tuple[str, pa.DataType]]:
    """The label's column in the shuffle and the shards; none for next_token, whose target
    is its token column."""
    if spec.task == "next_token":
        return []
    return [(spec.label, pa.int64() if spec.task == "classification" else pa.float32())]


def shuffle_rows(unit: Unit, task: PrepareTask, stats: FittedStatistics, parts: Parts) -> Iterator[pa.Table]:
    """The unit's usable rows, transformed, with their part and position."""
    return shuffle_units([unit], task, stats, parts)


def shuffle_units(units: list[Unit] | tuple[Unit, ...], task: PrepareTask, stats: FittedStatistics,
                  parts: Parts) -> Iterator[pa.Table]:
    """shuffle_rows of consecutive units, in unit order; small units parsed together."""
    spec = task.spec
    schema = transport_schema(spec)
    width = feature_width(spec) * 4
    impute = spec.on_invalid_features == "impute"
    for chunk in read_chunks(units, task.columns, task.delimiter):
        if isinstance(chunk, Unreadable):  # pass 1 read it: the file changed since
            raise DataError(f"{display(chunk.unit.url)}: changed since it was checked ({chunk.error})")
        table, where = chunk
        p = task.parse(table, where.base)
        keep = ~p.mask(BAD_KINDS)
        if not task.drop_bad and not keep.all():
            raise DataError(f"{display(where.locate(int(np.argmin(keep)))[0].url)}: changed since it was checked")
        feats = features(p.numeric, p.categorical, p.vectors, p.n, spec, stats, impute)[keep]
        rows = np.flatnonzero(keep)
        m = len(rows)
        offsets = pa.array(np.arange(m + 1, dtype=np.int32) * width)  # width 0: no tabular column
        label = p.label[keep] if spec.task == "classification" else p.label[keep].astype(np.float32)
        yield pa.Table.from_arrays(
            [
                pa.array(p.key[keep]),
                *([pa.array(label)] if label_fields(spec) else []),
                pa.Array.from_buffers(pa.binary(), m, [None, offsets.buffers()[1], pa.py_buffer(feats)]),
                *(binary_rows(p.tensors[c][keep]) for c in spec.tensors),
                *(p.images[c].filter(pa.array(keep)) for c in spec.images),
                pa.array(where.positions(rows)),
                pa.array(parts.of(p.split[keep], shard_hash(p.key[keep]))),
            ],
            schema=schema,
        )


def existing_rows(url: str, index: int, spec: FeatureSpec, parts: Parts, split: SplitConfig) -> Iterator[pa.Table]:
    """The keys of an existing shard (an append checks new keys against them), routed like
    new rows; position negative (`index` < 0), so they come first among equal keys.
    Label and features are zero and empty, not null: every partition keeps one schema."""
    schema = transport_schema(spec)
    with storage.open_input(url) as f:  # a shard: Parquet read by byte ranges
        keys = pq.read_table(f, columns=[spec.key]).column(spec.key).to_numpy()
    n = len(keys)
    empty = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(np.zeros(n + 1, np.int32)), pa.py_buffer(b"")])
    yield pa.Table.from_arrays(
        [
            pa.array(keys),
            *(pa.array(np.zeros(n, t.to_pandas_dtype())) for _, t in label_fields(spec)),
            empty,
            *(empty for _ in (*spec.tensors, *spec.images)),
            pa.array((np.int64(index) << 32) | np.arange(n, dtype=np.int64)),
            pa.array(parts.of(split_codes(keys, split), shard_hash(keys))),
        ],
        schema=schema,
    )
