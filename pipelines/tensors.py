"""Typed tensor columns: raw values checked against a declared dtype and shape, stored as
their own bytes. Pure numpy/pyarrow, the same in Spark's and Dask's tasks.

A shard holds a tensor column as `fixed_size_binary(itemsize x elements)`: each row's
elements in C order, little-endian, in the declared dtype (bfloat16 as its 16 bits, the
top half of the float32). No widening: a uint8 image tensor costs one byte an element.
The manifest names dtype and shape (encoding "raw"); `decode_raw` turns a column back
into numpy [rows, *shape].

Raw values: Arrow lists (nested for more dimensions; Parquet) or JSON arrays (CSV and
JSON text). Problems, per row, each a bad row (`on_bad_rows`):
- "bad_shape": missing, not a list, or not exactly the declared shape (a 1-D integer
  sequence may be shorter with `pad_id`, longer with `truncate`);
- "bad_dtype": a value the dtype cannot hold (a fraction or a float column for an
  integer dtype, an integer out of range, a float beyond float16's range, text);
- "out_of_vocab": an integer id at or above `vocab_size`, or negative.
NaN and inf in a float tensor are "invalid" (`on_invalid_features`; impute writes 0).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import TensorColumn

TENSOR_KINDS = ("bad_shape", "bad_dtype", "out_of_vocab")
INTEGER = ("uint8", "int32", "int64")


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a tensor's elements are stored as (bfloat16: its uint16 bits)."""
    return np.dtype("<u2" if dtype == "bfloat16" else dtype).newbyteorder("<")


def elements(col: TensorColumn) -> int:
    return math.prod(col.shape)


def row_bytes(col: TensorColumn) -> int:
    return storage_dtype(col.dtype).itemsize * elements(col)


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (torch's rounding); NaN stays NaN."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    return np.where(np.isnan(x), np.uint32(0x7FC0), rounded).astype(np.uint16)


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def parse_tensor(col, spec: TensorColumn, nulls: list[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(uint8 [n, row_bytes]: each row's stored bytes, zeros where bad; problems kind -> mask)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    n = len(col)
    t = col.type
    dtype_bad = np.zeros(n, bool)
    if _is_list(t):
        values, row_of, shape_bad = _flatten_lists(col, spec)
    else:
        values, row_of, shape_bad = _from_text(col, spec, nulls, dtype_bad)
    problems = {"bad_shape": shape_bad}
    width = elements(spec)
    out = np.zeros((n, width), storage_dtype(spec.dtype))
    invalid = np.zeros(n, bool)
    if spec.pad_id is not None:  # under the ids: what they leave uncovered (an empty sequence too)
        out[:] = spec.pad_id
    if values is not None and len(values):
        flat, bad_value, not_finite, vocab = _typed(values, spec)
        for mask, target in ((bad_value, dtype_bad), (not_finite, invalid)):
            np.logical_or.at(target, row_of[mask], True)
        out_of_vocab = np.zeros(n, bool)
        np.logical_or.at(out_of_vocab, row_of[vocab], True)
        problems["out_of_vocab"] = out_of_vocab & ~dtype_bad & ~shape_bad
        dtype_bad &= ~shape_bad
        good = ~shape_bad[row_of] & ~dtype_bad[row_of]
        _scatter(out, flat[good], row_of[good])
    problems["bad_dtype"] = dtype_bad
    problems["invalid"] = invalid & ~shape_bad & ~dtype_bad
    bad = shape_bad | dtype_bad | problems.get("out_of_vocab", np.zeros(n, bool))
    out[bad] = 0
    return out.view(np.uint8).reshape(n, -1), {k: m for k, m in problems.items() if m.any()}


def _is_list(t) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _flatten_lists(col: pa.Array, spec: TensorColumn):
    """Arrow nested lists: (leaf values, row of each, rows whose shape is wrong)."""
    n = len(col)
    bad = np.zeros(n, bool)
    row_of = np.arange(n)
    cur = col
    if spec.pack:  # a list of sequences per row: their ids end to end, as one sequence
        if not _is_list(cur.type.value_type):
            return None, row_of, np.ones(n, bool)
        null = pc.is_null(cur).to_numpy(zero_copy_only=False).astype(bool)
        inner = cur.flatten()
        parents = pc.list_parent_indices(cur).to_numpy(zero_copy_only=False)
        np.logical_or.at(bad, parents[pc.is_null(inner).to_numpy(zero_copy_only=False).astype(bool)], True)
        lengths = pc.fill_null(pc.list_value_length(inner), 0).to_numpy(zero_copy_only=False)
        per_row = np.bincount(parents, weights=lengths, minlength=n).astype(np.int64)
        offsets = np.r_[0, np.cumsum(per_row)].astype(np.int64)
        cur = pa.LargeListArray.from_arrays(pa.array(offsets), inner.flatten(), mask=pa.array(null))
    sequence = spec.pad_id is not None or spec.truncate or spec.pack
    for want in spec.shape:
        if not _is_list(cur.type):
            return None, row_of, np.ones(n, bool)  # fewer dimensions than declared
        lengths = pc.fill_null(pc.list_value_length(cur), -1).to_numpy(zero_copy_only=False)
        wrong = lengths != want
        if sequence:  # 1-D: shorter pads, longer truncates, when allowed
            short = lengths < want if spec.pad_id is None else np.zeros(len(lengths), bool)
            long = lengths > want if not spec.truncate else np.zeros(len(lengths), bool)
            wrong = (lengths < 0) | short | long
        np.logical_or.at(bad, row_of[wrong], True)
        parents = pc.list_parent_indices(cur).to_numpy(zero_copy_only=False)
        row_of = row_of[parents]
        cur = cur.flatten()
    if _is_list(cur.type):
        return None, row_of, np.ones(n, bool)  # more dimensions than declared
    null = pc.is_null(cur).to_numpy(zero_copy_only=False).astype(bool)
    np.logical_or.at(bad, row_of[null], True)
    return cur, row_of, bad


def _from_text(col: pa.Array, spec: TensorColumn, nulls: list[str], dtype_bad: np.ndarray):
    """JSON arrays as text (CSV, JSON lines), row by row: (leaf values, row of each, bad
    shape); rows of text or objects are marked in `dtype_bad`."""
    n = len(col)
    bad = np.zeros(n, bool)
    null_set = {v.lower() for v in nulls}
    is_text = pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
    rows, parts, kinds = [], [], set()
    for i, v in enumerate(col.to_pylist() if is_text else [None] * n):
        try:
            v = json.loads(v) if isinstance(v, str) and v.strip().lower() not in null_set else None
            if spec.pack and isinstance(v, list):
                v = [x for seq in v for x in seq] if all(isinstance(s, list) for s in v) else None
            arr = np.asarray(v) if isinstance(v, list) else None
        except ValueError:  # not JSON, or ragged nesting
            arr = None
        if arr is None or not _shape_ok(arr.shape, spec):
            bad[i] = True
            continue
        if arr.dtype.kind not in "iufb":
            dtype_bad[i] = True
            continue
        arr = arr.reshape(-1)
        kinds.add(arr.dtype.kind)
        parts.append(arr)
        rows.append(np.full(len(arr), i))
    if not parts:
        return None, np.zeros(0, np.int64), bad
    # Per row kinds: a float row in an integer tensor is bad_dtype for that row only.
    values = pa.chunked_array(
        [pa.array(p.astype(np.float64) if p.dtype.kind == "f" else p.astype(np.int64) if p.dtype.kind in "iu"
                  else p) for p in parts]
    ) if len(kinds) == 1 else None
    if values is None:
        return _MixedRows(parts), np.concatenate(rows), bad
    return values.combine_chunks(), np.concatenate(rows), bad


class _MixedRows:
    """Rows whose element kinds differ (ints in some rows, floats or booleans in others)."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)


def _shape_ok(shape: tuple, spec: TensorColumn) -> bool:
    if spec.pad_id is not None or spec.truncate or spec.pack:
        return len(shape) == 1 and (
            shape[0] == spec.shape[0]
            or (shape[0] < spec.shape[0] and spec.pad_id is not None)
            or (shape[0] > spec.shape[0] and spec.truncate)
        )
    return list(shape) == spec.shape


def _typed(values, spec: TensorColumn):
    """Leaf values in the stored dtype: (flat, bad value, NaN/inf, out of vocabulary) per element."""
    if isinstance(values, _MixedRows):
        out = [_typed(pa.array(p.astype(np.float64) if p.dtype.kind == "f" else p.astype(np.int64)
                               if p.dtype.kind in "iu" else p), spec) for p in values.parts]
        return tuple(np.concatenate([o[i] for o in out]) for i in range(4))
    t = values.type
    m = len(values)
    no = np.zeros(m, bool)
    target = storage_dtype(spec.dtype)
    if pa.types.is_integer(t):
        x = values.to_numpy(zero_copy_only=False)
        if spec.dtype in INTEGER:
            info = np.iinfo(spec.dtype)
            bad = (x < info.min) | (x > info.max) if x.dtype.kind == "i" else x > info.max
            vocab = no if spec.vocab_size is None else ~bad & ((x < 0) | (x >= spec.vocab_size))
            return np.where(bad, 0, x).astype(target), bad, no, vocab
        x = x.astype(np.float64)
    elif pa.types.is_floating(t) or pa.types.is_decimal(t):
        x = values.cast(pa.float64()).to_numpy(zero_copy_only=False)
        if spec.dtype in INTEGER:
            return np.zeros(m, target), np.ones(m, bool), no, no  # a float column: another dtype
    else:
        return np.zeros(m, target), np.ones(m, bool), no, no  # booleans, text
    finite = np.isfinite(x)
    limit = np.finfo(np.float16 if spec.dtype == "float16" else np.float32).max
    with np.errstate(invalid="ignore"):
        bad = finite & (np.abs(x) > limit)
    x = np.where(finite & ~bad, x, 0.0)
    if spec.dtype == "bfloat16":
        return to_bfloat16_bits(x.astype(np.float32)), bad, ~finite, no
    return x.astype(target), bad, ~finite, no


def _scatter(out: np.ndarray, flat: np.ndarray, rows: np.ndarray) -> None:
    """Put each good row's elements in place, cut at the declared length."""
    if not len(rows):
        return
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    pos = np.arange(len(rows)) - np.repeat(starts, np.diff(np.r_[starts, len(rows)]))
    keep = pos < out.shape[1]
    out[rows[keep], pos[keep]] = flat[keep]


def tensor_array(data: np.ndarray) -> pa.Array:
    """uint8 [n, row_bytes] as the fixed_size_binary column shards hold."""
    n, width = data.shape
    return pa.Array.from_buffers(pa.binary(width), n, [None, pa.py_buffer(np.ascontiguousarray(data))])


def decode_raw(arr: pa.Array, dtype: str, shape: list[int]) -> np.ndarray:
    """A fixed_size_binary (or binary) shard column as numpy [rows, *shape] of the stored dtype."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    n = len(arr)
    st = storage_dtype(dtype)
    width = st.itemsize * math.prod(shape)
    if pa.types.is_fixed_size_binary(arr.type):
        data = np.frombuffer(arr.buffers()[1], np.uint8)[arr.offset * width : (arr.offset + n) * width]
    else:  # variable binary of fixed-size rows (the shuffle's transport)
        offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset : arr.offset + n + 1]
        data = np.frombuffer(arr.buffers()[2], np.uint8)[offsets[0] : offsets[-1]]
    return data.view(st).reshape(n, *shape)


def binary_rows(data: np.ndarray) -> pa.Array:
    """uint8 [n, width] as a variable binary column: the shuffle carries every kind as binary."""
    n, width = data.shape
    offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(data))])
