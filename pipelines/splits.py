"""Split assignment: a pure function of the key, identical on every engine."""

from __future__ import annotations

from .config import SplitConfig

SPLITS = ("train", "val", "test")
BUCKETS = 10_000
# Split and shard hash the key with different salts, so they are independent.
SPLIT_SALT = 42
SHARD_SALT = 1_234_567


def split_thresholds(split: SplitConfig) -> tuple[int, int]:
    """Bucket bounds: bucket < t_train is train, < t_val is val, the rest test."""
    t_train = round(split.train * BUCKETS)
    t_val = round((split.train + split.val) * BUCKETS)
    return t_train, t_val
