"""Row-level work shared by the engines: parse, split, report. Arrow compute and numpy.

Spark and Dask call these inside their tasks on the same units (raw.py), so every
row is parsed, split and counted by one code path. The parse, for every format:

- text is trimmed; one of `features.null_values` (any case) is null;
- a number is `[+-]digits[.digits][e[+-]digits]`, `inf`/`infinity` or `nan` (any
  case); anything else in a numeric, key or label column is a value that does not
  parse (a "bad" row);
- a key is an integer: an integer type, integer text (exact, within int64), or
  an integral float within +-2^53; a float NaN is null;
- a categorical value is the column's text (numbers and booleans cast by Arrow).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from .config import FeatureSpec, SplitConfig
from .hashing import bucket, hash64
from .images import IMAGE_KINDS, parse_images
from .tensors import TENSOR_KINDS, parse_tensor
from .splits import BUCKETS, SHARD_SALT, SPLIT_SALT, SPLITS, split_thresholds

# Problems that make a row unusable (fail, or dropped with on_bad_rows = "drop");
# "invalid" (NaN/inf/null features) follows on_invalid_features instead.
BAD_KINDS = ("bad", "null_key", "null_label", "negative_label", "unknown_label", *TENSOR_KINDS, *IMAGE_KINDS)
INVALID = "invalid"

_NUMBER = r"(?i)^[+-]?((\d+\.?\d*|\.\d+)(e[+-]?\d+)?|inf|infinity|nan)$"
_INTEGER = r"^[+-]?\d{1,18}$"
_INT64_MAX = str(2**63 - 1)
_EXACT = float(2**53)  # floats beyond this are not exact integers


@dataclass
class Parsed:
    """One batch of raw rows as typed numpy columns, with what went wrong where."""

    n: int
    key: np.ndarray  # int64
    label: np.ndarray  # int64 class index (classification) or float64
    numeric: dict[str, np.ndarray]  # float64, NaN where null
    categorical: dict[str, tuple[np.ndarray, list[str]]]  # codes (-1 null) into values
    vectors: dict[str, np.ndarray]  # float64 [n, length]
    split: np.ndarray  # int8 index into SPLITS
    problems: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)  # (kind, column) -> mask
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # uint8 [n, row bytes], stored form
    images: dict[str, pa.Array] = field(default_factory=dict)  # binary: encoded, empty where bad

    def mask(self, kinds) -> np.ndarray:
        out = np.zeros(self.n, bool)
        for (kind, _), m in self.problems.items():
            if kind in kinds:
                out |= m
        return out


def parse(
    table: pa.Table, spec: FeatureSpec, split: SplitConfig, num_classes: int | None, base: str | None = None
) -> Parsed:
    """Parse `table` (raw columns) by `spec`. `num_classes`: labels at or above it are
    unknown (declared classes, or a dataset's classes on append); None infers them.
    `base`: the raw file's folder, which relative image paths start from."""
    problems: dict[tuple[str, str], np.ndarray] = {}

    def note(kind: str, col: str, mask: np.ndarray) -> None:
        if mask.any():
            key = (kind, col)
            problems[key] = problems[key] | mask if key in problems else mask

    if spec.task == "next_token":
        # The target is the token tensor itself, parsed and checked below as a tensor.
        label = np.zeros(table.num_rows, np.int64)
    else:
        if spec.task == "classification":
            label, null, bad, negative, unknown = class_labels(table.column(spec.label), spec, num_classes)
            note("negative_label", spec.label, negative)
            note("unknown_label", spec.label, unknown)
        else:
            label, null, bad = numbers(table.column(spec.label), spec.null_values)
            bad |= ~np.isfinite(label) & ~null
        note("bad", spec.label, bad)
        note("null_label", spec.label, null)

    numeric, categorical, vectors, feature_problems = parse_features(table, spec)
    for (kind, c), mask in feature_problems.items():
        note(kind, c, mask)
    tensors, images = {}, {}
    for c, col in spec.tensors.items():
        tensors[c], found = parse_tensor(table.column(c), col, spec.null_values)
        for kind, mask in found.items():
            note(kind, c, mask)
    for c, col in spec.images.items():
        images[c], found = parse_images(table.column(c), col, base)
        for kind, mask in found.items():
            note(kind, c, mask)

    if spec.generate_key:
        blobs = {**tensors, **{c: a.to_pylist() for c, a in images.items()}}
        key = content_key(label, numeric, categorical, {**vectors, **blobs}, spec)
    else:
        key, null, bad = keys(table.column(spec.key), spec.null_values)
        note("bad", spec.key, bad)
        note("null_key", spec.key, null)
    return Parsed(table.num_rows, key, label, numeric, categorical, vectors, split_codes(key, split), problems,
                  tensors=tensors, images=images)


def parse_features(table: pa.Table, spec: FeatureSpec):
    """The feature columns of `table`: (numeric, categorical, vectors, problems).

    Problems: ("bad", column) for values that do not parse, ("invalid", column) for
    NaN, inf or null features. Serving transforms raw input with this too.
    """
    nulls = spec.null_values
    problems: dict[tuple[str, str], np.ndarray] = {}
    numeric = {}
    for c in spec.numeric:
        numeric[c], _, bad = numbers(table.column(c), nulls)
        problems["bad", c] = bad
        problems[INVALID, c] = ~np.isfinite(numeric[c]) & ~bad
    categorical = {c: categories(table.column(c), nulls) for c in spec.categorical}
    vectors = {}
    for c, length in spec.vectors.items():
        vectors[c], bad, invalid = vector_values(table.column(c), length, nulls)
        problems["bad", c] = bad
        problems[INVALID, c] = invalid
    return numeric, categorical, vectors, {k: m for k, m in problems.items() if m.any()}


# -- columns -------------------------------------------------------------------------


def _array(col) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _text(col: pa.Array, nulls: list[str]) -> tuple[pa.Array, np.ndarray]:
    """Trimmed text and where it is null (a missing value or one of `nulls`)."""
    text = pc.utf8_trim_whitespace(col.cast(pa.string()))
    null = pc.or_kleene(pc.is_null(col), pc.is_in(pc.utf8_lower(text), pa.array([v.lower() for v in nulls], pa.string())))
    return text, _bools(null)


def _bools(arr) -> np.ndarray:
    return pc.fill_null(arr, False).to_numpy(zero_copy_only=False).astype(bool)


def numbers(col, nulls: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(float64 values with NaN where null or bad, null mask, bad mask)."""
    col = _array(col)
    t = col.type
    n = len(col)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        x = pc.fill_null(col.cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False)
        null = _bools(pc.is_null(col)) | (np.isnan(x) if pa.types.is_floating(t) else False)
        return x, null, np.zeros(n, bool)
    if pa.types.is_null(t):
        return np.full(n, math.nan), np.ones(n, bool), np.zeros(n, bool)
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        null = _bools(pc.is_null(col))
        return np.full(n, math.nan), null, ~null  # booleans, lists, dates: not numbers
    text, null = _text(col, nulls)
    ok = _bools(pc.match_substring_regex(text, _NUMBER)) & ~null
    x = pc.cast(pc.if_else(pa.array(ok), text, "nan"), pa.float64()).to_numpy(zero_copy_only=False)
    return np.where(ok, x, math.nan), null, ~ok & ~null


def keys(col, nulls: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int64 keys, 0 where null or bad; null mask; bad mask). Integers stay exact."""
    col = _array(col)
    t = col.type
    n = len(col)
    if pa.types.is_integer(t):
        null = _bools(pc.is_null(col))
        if pa.types.is_unsigned_integer(t):
            big = _bools(pc.greater(col, 2**63 - 1))
            col = pc.if_else(pa.array(big), pa.scalar(0, t), col)
        else:
            big = np.zeros(n, bool)
        k = pc.fill_null(col.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        return k, null, big
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        text, null = _text(col, nulls)
        # Up to 18 digits always fit an int64; 19 when they do not exceed its maximum.
        magnitude = pc.replace_substring_regex(text, r"^[+-]", "")
        fits = pc.or_(
            pc.match_substring_regex(text, _INTEGER),
            pc.and_(pc.match_substring_regex(text, r"^[+-]?\d{19}$"), pc.less_equal(magnitude, _INT64_MAX)),
        )
        exact = _bools(fits) & ~null
        digits = pc.replace_substring_regex(text, r"^\+", "")  # Arrow's integer parse refuses a '+'
        k = pc.cast(pc.if_else(pa.array(exact), digits, "0"), pa.int64()).to_numpy(zero_copy_only=False)
        x, _, bad = numbers(pc.if_else(pa.array(exact | null), pa.scalar(None, pa.string()), text), [])
        whole, ok = _integral(x)
        k = np.where(exact, k, np.where(ok, whole, 0))
        return k, null, ~exact & ~null & ~ok
    x, null, bad = numbers(col, nulls)
    whole, ok = _integral(x)
    return np.where(ok, whole, 0), null, ~ok & ~null


def _integral(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(x) & (x == np.floor(x)) & (np.abs(x) <= _EXACT)
    return np.where(ok, x, 0).astype(np.int64), ok


def class_labels(col, spec: FeatureSpec, num_classes: int | None):
    """(class index, null, bad, negative, unknown) masks for a classification label."""
    col = _array(col)
    n = len(col)
    names = spec.class_names
    if names is not None:
        text, null = _text(col, spec.null_values)
        idx = pc.index_in(text, value_set=pa.array(names, pa.string()))
        known = _bools(pc.is_valid(idx))
        label = pc.fill_null(idx, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        no = np.zeros(n, bool)
        return label, null, no, no, ~known & ~null
    label, null, bad = keys(col, spec.null_values)
    ok = ~null & ~bad
    negative = ok & (label < 0)
    unknown = ok & (label >= num_classes) if num_classes is not None else np.zeros(n, bool)
    return np.where(ok, label, -1), null, bad, negative, unknown


def categories(col, nulls: list[str]) -> tuple[np.ndarray, list[str]]:
    """Dictionary codes (-1 where null) and the values they index (text as it is)."""
    col = _array(col)
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        col = col.cast(pa.string())
    enc = pc.dictionary_encode(col)
    values = enc.dictionary
    _, null_value = _text(values, nulls)
    codes = pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    if null_value.any():
        codes = np.where(null_value[np.maximum(codes, 0)] & (codes >= 0), -1, codes)
    return codes, values.to_pylist()


def vector_values(col, length: int, nulls: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(float64 [n, length], bad, invalid): bad = missing, wrong length or not numbers."""
    col = _array(col)
    n = len(col)
    t = col.type
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and (
        pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)
    ):
        lengths = pc.fill_null(pc.list_value_length(col), -1).to_numpy(zero_copy_only=False)
        bad = lengths != length
        ok = pc.filter(col, pa.array(~bad))
        vals = pc.fill_null(ok.flatten().cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False)
        out = np.zeros((n, length))
        out[~bad] = vals.reshape(-1, length)
    else:
        # Text (CSV, JSON) or lists of anything: each row as JSON, element by element.
        out = np.zeros((n, length))
        bad = np.zeros(n, bool)
        null_set = {v.lower() for v in nulls}
        for i, v in enumerate(col.to_pylist()):
            if isinstance(v, str):
                if v.strip().lower() in null_set:
                    v = None
                else:
                    try:
                        v = json.loads(v)
                    except ValueError:
                        v = None
            try:
                arr = np.asarray(v, dtype=np.float64) if v is not None else None
            except (TypeError, ValueError):
                arr = None
            if arr is None or arr.shape != (length,):
                bad[i] = True
            else:
                out[i] = arr
    with np.errstate(invalid="ignore"):
        invalid = ~np.isfinite(out).all(axis=1)
    return out, bad, invalid & ~bad


def content_key(label, numeric, categorical, vectors, spec: FeatureSpec) -> np.ndarray:
    """A non-negative int64 per row from its parsed values (pandas' stable hashing)."""
    parts: dict[str, object] = {} if spec.task == "next_token" else {spec.label: label}
    parts.update(numeric)
    for c, (codes, values) in categorical.items():
        names = np.array([*values, None], dtype=object)
        parts[c] = names[np.where(codes >= 0, codes, len(values))]
    for c, v in vectors.items():  # also tensors' bytes and encoded images
        parts[c] = np.array([row if isinstance(row, bytes) else row.tobytes() for row in v], dtype=object)
    h = pd.util.hash_pandas_object(pd.DataFrame(parts), index=False).to_numpy()
    return (h >> np.uint64(1)).astype(np.int64)


# -- split and shard -----------------------------------------------------------------


def split_codes(keys: np.ndarray, split: SplitConfig) -> np.ndarray:
    """0 (train), 1 (val) or 2 (test) per key: a hash of the key alone."""
    t_train, t_val = split_thresholds(split)
    b = bucket(keys, SPLIT_SALT, BUCKETS)
    return (b >= t_train).astype(np.int8) + (b >= t_val).astype(np.int8)


def split_of(keys: np.ndarray, split: SplitConfig) -> np.ndarray:
    """The split's name per key."""
    return np.array(SPLITS, dtype=object)[split_codes(keys, split)]


def shard_hash(keys: np.ndarray) -> np.ndarray:
    """A non-negative int64 per key, independent of the split hash: shard = it mod count."""
    return (hash64(keys, SHARD_SALT) >> np.uint64(1)).astype(np.int64)
