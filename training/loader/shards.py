"""One rank's shards of a split: which they are, and reading them (training.loader.reader's
ShardLoader reads through a ShardReader).

Rank r of w reads shards r, r+w, r+2w, ... of a split (`rank_shards`), a disjoint and
complete cover; nothing else is opened. Each shard is opened through storage (a local
file, or ranged reads of an object) and its Parquet footer checked against the manifest
(rows and row groups; with `verify`, its sha256 too). A row group is read and decoded
into a chunk: every input column in shard column order (training.loader.columns), then
the label; any thread may ask, each keeps its own open files.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from shardline.foundation import storage
from shardline.foundation.errors import DataError
from shardline.pipelines.manifest import ShardInfo, ShardManifest, TensorSpec
from shardline.pipelines.tensors import decode_raw

from .columns import decode_column, held_dtype, label_pad_id, label_tokens


def rank_shards(shards: list[ShardInfo], rank: int, world_size: int) -> list[ShardInfo]:
    return shards[rank::world_size]


def check_world_size(manifest: ShardManifest, split: str, world_size: int) -> None:
    n = len(manifest.split(split).shards)
    if world_size > n:
        raise DataError(
            f"world size {world_size} is greater than the {n} shard(s) of split '{split}': "
            f"re-prepare with pipelines.layout.world_size = {world_size}"
        )


def rows_per_rank(manifest: ShardManifest, split: str, world_size: int) -> list[int]:
    """The rows each rank of `world_size` reads from `split` (from the manifest alone)."""
    shards = manifest.split(split).shards
    return [sum(s.rows for s in rank_shards(shards, r, world_size)) for r in range(world_size)]


class ShardReader:
    """The shards `shards` of `manifest` in `dataset_dir`, opened and checked; their row groups
    decoded into chunks (`decode`, `decoded`)."""

    def __init__(self, manifest: ShardManifest, dataset_dir: str | Path, shards: list[ShardInfo], *,
                 verify: bool = False, label_scale: tuple[float, float] | None = None):
        self._label = manifest.tensors["label"].column
        self._y_spec = manifest.tensors["label"]
        # next_token's label: its token ids as int64 (label_tokens); else the label's own dtype.
        self._y_dtype = np.dtype(np.int64) if self._y_spec.encoding == "raw" else held_dtype(self._y_spec)
        self._y_ignore = label_pad_id(manifest)
        # (mean, std): the label comes out standardised (training.task.label_scale).
        self._label_scale = label_scale
        # The inputs in shard column order, then the label: the columns of every chunk.
        self.inputs: list[tuple[str, TensorSpec]] = [(n, t) for n, t in manifest.tensors.items() if n != "label"]
        self._images = manifest.feature_spec.images
        self.layout = [(tuple(t.shape), held_dtype(t)) for _, t in self.inputs] + [
            (tuple(self._y_spec.shape), self._y_dtype)]
        # Shards open through storage: a local file or ranged reads of an object (pyarrow.fs).
        self._paths = [storage.join(str(dataset_dir), s.path) for s in shards]
        self._meta = [self._open(path, s, verify) for path, s in zip(self._paths, shards)]
        # Open files per decoding thread: opening one per row group costs ~10% of an epoch.
        self._files = threading.local()
        # Rows per row group, per shard, from the Parquet footers.
        self.groups = [[m.row_group(g).num_rows for g in range(m.num_row_groups)] for m in self._meta]

    @property
    def row_bytes(self) -> int:
        """Bytes of one decoded row (every chunk column's)."""
        return sum(d.itemsize * math.prod(s) for s, d in self.layout)

    @staticmethod
    def _open(url: str, shard: ShardInfo, verify: bool):
        path = storage.display(url)
        if verify:
            digest = hashlib.sha256()
            try:
                with storage.open_stream(url, compression=None) as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        digest.update(chunk)
            except FileNotFoundError:
                raise DataError(f"{path}: shard named by the manifest is missing") from None
            if digest.hexdigest() != shard.sha256:
                raise DataError(
                    f"{path}: sha256 {digest.hexdigest()[:12]}... differs from the manifest's "
                    f"{shard.sha256[:12]}...: the shard changed after prepare; re-prepare the dataset"
                )
        try:
            with storage.open_input(url) as f:
                meta = pq.ParquetFile(f).metadata
        except FileNotFoundError:
            raise DataError(f"{path}: shard named by the manifest is missing") from None
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable Parquet shard ({e})") from None
        if meta.num_rows != shard.rows:
            raise DataError(f"{path}: {meta.num_rows} rows, the manifest says {shard.rows}")
        if meta.num_row_groups != shard.row_groups:
            raise DataError(
                f"{path}: {meta.num_row_groups} row groups, the manifest says {shard.row_groups}"
            )
        return meta

    def decoded(self, units, pool, workers: int) -> Iterator[tuple[np.ndarray, ...]]:
        """The chunk of each row group (shard, group, rows), in the order given; `pool` (of
        `workers` threads) decodes ahead."""
        if pool is None:
            for u in units:
                yield self.decode(u)
            return
        window: deque = deque()
        # One row group in flight and one done per worker keeps every worker busy; more
        # only holds memory (a row group of wide features is tens of MB), and measured
        # no faster than 2 per worker.
        ahead = 2 * workers
        try:
            for u in units:
                window.append(pool.submit(self.decode, u))
                if len(window) > ahead:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        finally:
            for f in window:
                f.cancel()

    def decode(self, unit: tuple[int, int, int]) -> tuple[np.ndarray, ...]:
        """One row group as its chunk: every input column decoded, then the label."""
        si, g, rows = unit
        path = storage.display(self._paths[si])
        # Each column once: a next_token label is its input's column.
        columns = list(dict.fromkeys([t.column for _, t in self.inputs] + [self._label]))
        try:
            table = self._file(si).read_row_group(g, columns=columns, use_threads=False)
        except Exception as e:
            raise DataError(f"{path}: row group {g} cannot be read ({e})") from None
        labels = table.column(self._label).combine_chunks()
        if self._y_spec.encoding == "raw":  # next_token: the token ids, pads marked ignored
            y = label_tokens(decode_raw(labels, self._y_spec.dtype, self._y_spec.shape), self._y_ignore)
        else:
            y = np.asarray(labels.to_numpy(zero_copy_only=False), dtype=self._y_dtype)
        if len(y) != rows:
            raise DataError(f"{path}: row group {g} holds {len(y)} rows; the manifest says {rows}")
        if self._label_scale is not None:
            mean, std = self._label_scale
            y = ((y.astype(np.float64) - mean) / std).astype(self._y_dtype)
        chunk = [decode_column(table.column(t.column), t, self._images, rows, f"{path}: row group {g}")
                 for _, t in self.inputs]
        return (*chunk, y)

    def _file(self, si: int) -> pq.ParquetFile:
        files = self._files.__dict__.setdefault("by_shard", {})
        if si not in files:
            url = self._paths[si]
            # pre_buffer on object stores: one coalesced ranged read per row group, not one per column.
            files[si] = pq.ParquetFile(
                storage.open_input(url), metadata=self._meta[si], pre_buffer=storage.is_remote(url)
            )
        return files[si]
