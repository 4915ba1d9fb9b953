"""Stable 64-bit hashes of integer keys, in numpy: the same on every engine and machine.

Split, shard and synthetic values are pure functions of (key, salt), so a row
lands in the same split on Spark and Dask, on every re-run and after an append.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def hash64(keys: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of key mixed with salt, as uint64 (wrapping arithmetic is intended)."""
    z = np.asarray(keys).astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(salt & 0xFFFFFFFFFFFFFFFF) * _GOLDEN + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def bucket(keys: np.ndarray, salt: int, n: int) -> np.ndarray:
    """A bucket in [0, n) per key."""
    return (hash64(keys, salt) % np.uint64(n)).astype(np.int64)


def uniform(keys: np.ndarray, salt: int) -> np.ndarray:
    """A float64 in (0, 1) per key, never 0 or 1."""
    return ((hash64(keys, salt) >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
