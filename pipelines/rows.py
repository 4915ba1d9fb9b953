"""Row-level work shared by the engines: parse, tag, report. Pure pandas/numpy.

Spark calls these in `mapInPandas`, Dask in `map_partitions`: one code path, so
both engines parse, split and count every row identically.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
import pandas as pd
import pyarrow as pa

from .config import FeatureSpec, SplitConfig
from .hashing import bucket, hash64
from .splits import BUCKETS, SHARD_SALT, SPLIT_SALT, split_thresholds

# Problems that make a row unusable (fail, or dropped with on_bad_rows = "drop");
# "invalid" (NaN/inf features) follows on_invalid_features instead.
BAD_KINDS = ("bad", "null_key", "null_label", "negative_label")

FILE_COL = "_file"
SPLIT_COL = "_split"
SHARD_COL = "_shard"
# The key's shard hash, non-negative int64: shard = _h mod (the split's shard count).
# Parsed rows carry it, so an engine computes shards once counts are known,
# without parsing again (Spark: pmod, natively).
HASH_COL = "_h"


def typed_schema(spec: FeatureSpec) -> pa.Schema:
    """Columns of a parsed row, as both engines carry them to the shard writer."""
    label = pa.int64() if spec.task == "classification" else pa.float64()
    fields = [pa.field(spec.key, pa.int64()), pa.field(spec.label, label)]
    fields += [pa.field(c, pa.float64()) for c in spec.numeric]
    fields += [pa.field(c, pa.string()) for c in spec.categorical]
    fields += [pa.field(c, pa.list_(pa.float64())) for c in spec.vectors]
    fields += [pa.field(FILE_COL, pa.string()), pa.field(SPLIT_COL, pa.string())]
    fields.append(pa.field(HASH_COL, pa.int64()))
    return pa.schema(fields)


class Parsed:
    """One batch of raw rows parsed into typed columns, with what went wrong where."""

    def __init__(self, raw: pd.DataFrame, spec: FeatureSpec):
        self.spec = spec
        self.raw = raw.reset_index(drop=True)
        n = len(self.raw)
        self.bad = np.zeros(n, dtype=bool)  # a value that does not parse as its type
        self.problems: dict[str, dict[str, np.ndarray]] = {}
        self.cols: dict[str, object] = {}

        self.cols[spec.key] = None  # first column; filled below, once the values are parsed
        label = self._number(spec.label)
        self._note("null_label", spec.label, self._null(spec.label))
        if spec.task == "classification":
            integral = np.isfinite(label) & (label == np.floor(label))
            self._note("bad", spec.label, ~integral & ~self._null(spec.label))
            self._note("negative_label", spec.label, integral & (label < 0))
            self.cols[spec.label] = np.where(integral, label, -1).astype(np.int64)
        else:
            self._note("bad", spec.label, ~np.isfinite(label) & ~self._null(spec.label))
            self.cols[spec.label] = label

        for c in spec.numeric:
            x = self._number(c)
            self._note("invalid", c, ~np.isfinite(x))
            self.cols[c] = x
        for c in spec.categorical:
            col = self.raw[c]
            self.cols[c] = np.where(col.isna(), None, col.astype(str)).astype(object)
        for c, length in spec.vectors.items():
            self.cols[c] = self._vector(c, length)
        if spec.generate_key:
            self.cols[spec.key] = content_key(self.cols, spec)
            self.raw[spec.key] = self.cols[spec.key]  # problem reports name rows by it
        else:
            key = self._number(spec.key)
            key_ok = np.isfinite(key) & (key == np.floor(key)) & (np.abs(key) < 2**62)
            self._note("bad", spec.key, ~key_ok & ~self._null(spec.key))
            self._note("null_key", spec.key, self._null(spec.key))
            self.cols[spec.key] = np.where(key_ok, key, 0).astype(np.int64)
        for kind in BAD_KINDS:
            self.bad |= self.problems.get(kind, {}).get("_any", np.zeros(n, bool))

    # -- parsing -------------------------------------------------------------
    def _null(self, c: str) -> np.ndarray:
        col = self.raw[c]
        null = col.isna().to_numpy()
        if not pd.api.types.is_numeric_dtype(col):
            null |= col.map(lambda v: isinstance(v, str) and not v.strip()).to_numpy(bool)
        return null

    def _number(self, c: str) -> np.ndarray:
        col = self.raw[c]
        if pd.api.types.is_bool_dtype(col):
            self._note("bad", c, np.ones(len(col), bool))
            return np.full(len(col), np.nan)
        if not pd.api.types.is_numeric_dtype(col):
            col = col.astype(object).map(lambda v: v.strip() if isinstance(v, str) else v)
            x = pd.to_numeric(col, errors="coerce").to_numpy(np.float64)
            unparsed = np.isnan(x) & ~self._null(c) & ~col.map(_is_nan_text).to_numpy(bool)
            self._note("bad", c, unparsed)
            return x
        return col.to_numpy(np.float64, na_value=np.nan)

    def _vector(self, c: str, length: int) -> np.ndarray:
        out = np.empty(len(self.raw), dtype=object)
        bad = np.zeros(len(self.raw), bool)
        invalid = np.zeros(len(self.raw), bool)
        for i, v in enumerate(self.raw[c].tolist()):
            if isinstance(v, str):
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
                arr = np.zeros(length)
            invalid[i] = not np.isfinite(arr).all()
            out[i] = arr
        self._note("bad", c, bad)
        self._note("invalid", c, invalid & ~bad)
        return out

    def _note(self, kind: str, column: str, mask: np.ndarray) -> None:
        mask = np.asarray(mask, bool)
        if not mask.any():
            return
        by_col = self.problems.setdefault(kind, {})
        by_col[column] = by_col[column] | mask if column in by_col else mask
        by_col["_any"] = by_col["_any"] | mask if "_any" in by_col else mask.copy()

    # -- results -------------------------------------------------------------
    def frame(self, split: SplitConfig, drop_bad: bool) -> pd.DataFrame:
        """Typed rows tagged with split and shard hash; bad rows dropped when asked."""
        df = pd.DataFrame(self.cols)
        df[FILE_COL] = self.raw[FILE_COL].to_numpy() if FILE_COL in self.raw else ""
        df[SPLIT_COL] = split_of(df[self.spec.key].to_numpy(), split)
        df[HASH_COL] = shard_hash(df[self.spec.key].to_numpy())
        if drop_bad:
            df = df[~self.bad]
        return df

    def report(self, split: SplitConfig, encoding: str, drop_bad: bool) -> dict:
        """Counts, first examples and train-split statistics of this batch (JSON-able)."""
        spec = self.spec
        df = self.frame(split, drop_bad=False)
        keep = ~self.bad if drop_bad else np.ones(len(df), bool)
        splits = df[SPLIT_COL].to_numpy()
        rep: dict = {
            "rows": {s: int(((splits == s) & keep).sum()) for s in ("train", "val", "test")},
            "dropped": int((self.bad & ~keep).sum()) if drop_bad else 0,
            "problems": {},
        }
        for kind, by_col in self.problems.items():
            for col, mask in by_col.items():
                if col == "_any":
                    continue
                # Rows dropped as bad are reported as such, not again as invalid.
                mask = mask if kind in BAD_KINDS else mask & keep
                if not mask.any():
                    continue
                i = int(np.argmax(mask))
                rep["problems"].setdefault(kind, {})[col] = {
                    "count": int(mask.sum()),
                    "file": str(df[FILE_COL].iat[i]),
                    "key": _plain(self.raw[spec.key].iat[i]),
                    "value": _plain(self.raw[col].iat[i]),
                }
        labels = df[spec.label].to_numpy()[keep & ~self._null(spec.label)]
        if len(labels):
            rep["label_min"], rep["label_max"] = float(labels.min()), float(labels.max())
        train = keep & (splits == "train")
        rep["moments"] = {}
        for c in spec.numeric:
            x = df[c].to_numpy()[train]
            x = x[np.isfinite(x)]
            rep["moments"][c] = _moments(x)
        rep["categories"] = {}
        if encoding == "index":
            for c in spec.categorical:
                vals = df[c][train].dropna()
                rep["categories"][c] = {str(k): int(v) for k, v in vals.value_counts().items()}
        return rep


def content_key(cols: dict, spec: FeatureSpec) -> np.ndarray:
    """A non-negative int64 per row from its parsed values (pandas' stable hashing)."""
    parts = {c: cols[c] for c in (spec.label, *spec.numeric, *spec.categorical)}
    for c in spec.vectors:
        parts[c] = np.array([v.tobytes() for v in cols[c]], dtype=object)
    h = pd.util.hash_pandas_object(pd.DataFrame(parts), index=False).to_numpy()
    return (h >> np.uint64(1)).astype(np.int64)


def _is_nan_text(v) -> bool:
    return isinstance(v, str) and v.lower() in ("nan", "+nan", "-nan")


def _plain(v):
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (list, tuple, np.ndarray)):
        return str(list(v))[:60]
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)[:60]


def _moments(x: np.ndarray) -> list[float]:
    if not len(x):
        return [0, 0.0, 0.0]
    mean = float(x.mean())
    return [int(len(x)), mean, float(((x - mean) ** 2).sum())]


def split_of(keys: np.ndarray, split: SplitConfig) -> np.ndarray:
    t_train, t_val = split_thresholds(split)
    b = bucket(keys, SPLIT_SALT, BUCKETS)
    return np.where(b < t_train, "train", np.where(b < t_val, "val", "test")).astype(object)


def shard_hash(keys: np.ndarray) -> np.ndarray:
    return (hash64(keys, SHARD_SALT) >> np.uint64(1)).astype(np.int64)


def shard_of(hashes: np.ndarray, splits: np.ndarray, shards: Mapping[str, int]) -> np.ndarray:
    """Shard per row from its HASH_COL value and split (the Dask side; Spark uses pmod)."""
    out = np.zeros(len(hashes), np.int32)
    for s, n in shards.items():
        mask = splits == s
        if mask.any():
            out[mask] = hashes[mask] % n
    return out


def merge_reports(reports: list[dict]) -> dict:
    """Combine batch reports: sums, the first example, Chan's parallel variance merge."""
    out: dict = {"rows": {"train": 0, "val": 0, "test": 0}, "dropped": 0, "problems": {},
                 "moments": {}, "categories": {}}
    for r in reports:
        for s, n in r["rows"].items():
            out["rows"][s] += n
        out["dropped"] += r["dropped"]
        for kind, by_col in r["problems"].items():
            for col, p in by_col.items():
                have = out["problems"].setdefault(kind, {}).get(col)
                if have is None:
                    out["problems"][kind][col] = dict(p)
                else:
                    have["count"] += p["count"]
        for bound, pick in (("label_min", min), ("label_max", max)):
            if bound in r:
                out[bound] = pick(out.get(bound, r[bound]), r[bound])
        for c, (n, mean, m2) in r["moments"].items():
            n0, mean0, m20 = out["moments"].get(c, (0, 0.0, 0.0))
            total = n0 + n
            if total:
                delta = mean - mean0
                out["moments"][c] = (
                    total,
                    mean0 + delta * n / total,
                    m20 + m2 + delta * delta * n0 * n / total,
                )
        for c, counts in r["categories"].items():
            acc = out["categories"].setdefault(c, {})
            for v, n in counts.items():
                acc[v] = acc.get(v, 0) + n
    return out
