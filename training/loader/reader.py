"""Streaming, shuffled, exactly resumable batches from a prepared dataset's shards.

Sharding (training.loader.shards): rank r of w reads shards r, r+w, r+2w, ... of a
split, a disjoint and complete cover; nothing else is opened.

Equal samples per rank: every rank must run the same number of steps (DDP would
hang otherwise), so every rank yields the same number of samples per epoch, set
by `remainder`:
- `drop` (default): steps = (fewest rows on any rank) // local_batch. A rank with
  more rows stops early; the rows it leaves out are the tail of its epoch's
  shuffled stream, so different rows each epoch. No row repeats within an epoch.
- `pad`: steps = ceil((most rows on any rank) / local_batch). A rank that runs out
  starts its epoch's stream again from the beginning, so every row is seen at
  least once per epoch and some rows twice.

Order: one numpy generator per (seed, epoch, rank) shuffles the shard order, the
row-group order inside each shard, and drives a shuffle buffer of up to
`shuffle_buffer_rows` rows across row groups: after each row group is added the
buffer emits a uniformly drawn set of rows that brings it back to its size, and
at the end it emits the rest in random order. Its size starts at WARM_BATCHES local
batches and grows by 1/8 of the rows read up to `shuffle_buffer_rows` (ShuffleBuffer):
the first batch of an epoch waits for a few batches' rows, not for a full buffer. Every draw depends on row counts
only (manifest and Parquet metadata), never on values, timing or threads: the
same seed gives the same order on every run, with any `workers`/`prefetch`, and
on data prepared by Spark or by Dask (they write the same rows and row groups).

Resume: `state_dict()` is the position (epoch, batches delivered), which is the
same on every rank, plus the settings that shape the order. After
`load_state_dict`, `epoch(e)` replays the count-only draws up to the position
without decoding anything, reads just the row groups that still have rows in the
buffer, and yields exactly the remaining batches, mid-row-group included.

Named tensors: a dataset with tensor or image columns (`feature_spec.typed`) yields
dicts, one entry per `manifest.tensors` name: `features` (float32 [B, d], when the
spec has tabular columns), each tensor column (its dtype, [B, *shape]), each image
column (uint8 [B, C, H, W], decoded from PNG/JPEG in the decoding threads) and `label`
(int64 or float32 [B]; next_token: the token column again, [B, L], its pad_id positions
set to IGNORE_INDEX, -100, which the losses skip). Tabular datasets keep yielding `(x, y)`. The shuffle buffer
holds decoded rows, at most BUFFER_BYTES of them (`shuffle_buffer_rows` is lowered to fit).

Prefetch: with `workers` >= 1 a producer thread assembles batches into a queue of
`prefetch` batches (handed over in lists of up to prefetch / 2: one thread switch
per list), and `workers` threads decode up to 2 x workers row groups
ahead of it (pyarrow releases the GIL); they are consumed in plan order,
so threads never change the order. `workers=0` does everything inline. Arrow's float list becomes numpy
without a copy; rows are copied once into the shuffle buffer and once out of it
into batches. With CUDA present, batches come in pinned memory so the trainer's
`.to(device, non_blocking=True)` is asynchronous.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from shardline.foundation.errors import ConfigError, DataError
from shardline.pipelines.manifest import ShardManifest

from .. import collectives
from .batches import ShuffleBuffer, cut_batches
from .shards import ShardReader, check_world_size, rank_shards, rows_per_rank
from .columns import to_torch

REMAINDER_POLICIES = ("drop", "pad")
_STATE_VERSION = 1
# Settings that shape the sample order: a state saved under others cannot resume.
_ORDER_KEYS = ("seed", "world_size", "local_batch", "shuffle_buffer_rows", "remainder", "steps")
_DONE = object()  # the end of the read-ahead queue
# Decoded rows the shuffle buffer may hold, in bytes: 65,536 rows of 224 x 224 RGB images
# would be 9.9 GB. Tabular rows stay far below it (65,536 rows of 1,000 floats: 262 MB).
BUFFER_BYTES = 1 << 30
# The shuffle buffer starts emitting once it holds this many local batches (ShuffleBuffer's
# `warm`), then grows towards shuffle_buffer_rows as it reads: an epoch's first batch waits
# for 8 batches' rows, not 65,536 rows (a rank's whole epoch of images, decoded first).
WARM_BATCHES = 8


def epoch_steps(per_rank: list[int], local_batch: int, remainder: str) -> int:
    """Steps every rank takes per epoch (the same on all): see the module's `remainder`."""
    if remainder == "drop":
        return min(per_rank) // local_batch
    return math.ceil(max(per_rank) / local_batch)


class ShardLoader:
    """Local batches of one rank for one split: `(x float32 [local_batch, d], y [local_batch])`
    for tabular data, a dict of named tensors for data with tensor or image columns."""

    def __init__(
        self,
        manifest: ShardManifest,
        dataset_dir: str | Path,
        split: str,
        rank: int,
        world_size: int,
        local_batch: int,
        seed: int,
        *,
        remainder: str = "drop",
        shuffle_buffer_rows: int = 65_536,
        workers: int = 1,
        prefetch: int = 8,
        pin_memory: bool | None = None,
        verify: bool = False,
        label_scale: tuple[float, float] | None = None,
    ):
        if remainder not in REMAINDER_POLICIES:
            raise ConfigError(f"training.remainder {remainder!r} is not one of: drop, pad")
        for name, value, low in (
            ("local batch", local_batch, 1), ("training.shuffle_buffer_rows", shuffle_buffer_rows, 0),
            ("training.loader_workers", workers, 0), ("training.prefetch_depth", prefetch, 1),
        ):
            if value < low:
                raise ConfigError(f"{name} is {value}; it must be at least {low}")
        check_world_size(manifest, split, world_size)
        self.rank, self.world_size, self.local_batch, self.seed = rank, world_size, local_batch, seed
        self.remainder, self.shuffle_buffer_rows = remainder, shuffle_buffer_rows
        self.workers, self.prefetch = workers, prefetch
        # Pinning needs CUDA; without it there is no device copy to speed up.
        self.pin_memory = torch.cuda.is_available() and pin_memory is not False
        self._typed = manifest.feature_spec.typed
        mine = rank_shards(manifest.split(split).shards, rank, world_size)
        self._shards = ShardReader(manifest, dataset_dir, mine, verify=verify, label_scale=label_scale)
        self._groups = self._shards.groups  # rows per row group, per shard
        # Capped by memory, not by chance: the cap depends on the manifest alone, so the
        # order (and a saved state's shuffle_buffer_rows) is the same on every run.
        self.shuffle_buffer_rows = min(shuffle_buffer_rows, max(1, BUFFER_BYTES // self._shards.row_bytes))
        self.rows = sum(s.rows for s in mine)
        self._steps = epoch_steps(rows_per_rank(manifest, split, world_size), local_batch, remainder)
        self._position = (0, 0)  # (epoch, batches delivered in it)
        self._produced, self._busy = 0, 0.0

    # -- the public surface --------------------------------------------------

    def steps_per_epoch(self) -> int:
        return self._steps

    @property
    def row_groups(self) -> int:
        """The row groups this rank reads an epoch."""
        return sum(len(groups) for groups in self._groups)

    def state_dict(self) -> dict:
        """The position (the same on every rank) and the settings that shape the order."""
        epoch, batches = self._position
        return {
            "version": _STATE_VERSION, "epoch": epoch, "batches": batches, "seed": self.seed,
            "world_size": self.world_size, "local_batch": self.local_batch,
            "shuffle_buffer_rows": self.shuffle_buffer_rows, "remainder": self.remainder,
            "steps": self._steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (a `state_dict()`): mid-epoch, only with the same order (the
        same seed, data-parallel ranks, batch and buffer); at an epoch's end also at another
        data-parallel degree, whose next epoch's order is its own."""
        if state.get("version") != _STATE_VERSION:
            raise DataError(
                f"loader state of version {state.get('version')!r}; this loader reads {_STATE_VERSION}"
            )
        mine = self.state_dict()
        mesh_keys = ("world_size", "local_batch", "steps") if state.get("batches") == 0 else ()
        diff = [
            f"{k}={state.get(k)!r} (this loader has {mine[k]!r})"
            for k in _ORDER_KEYS
            if state.get(k) != mine[k] and k not in mesh_keys
        ]
        if diff:
            raise DataError("loader state is from a different sample order: " + ", ".join(diff))
        if not 0 <= state["batches"] <= self._steps:
            raise DataError(f"loader state is at batch {state['batches']} of an epoch of {self._steps}")
        self._position = (int(state["epoch"]), int(state["batches"]))

    def __len__(self) -> int:
        return self._steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The current epoch's batches (after load_state_dict: those not yet delivered);
        once they are all delivered the position is the next epoch's start, so the next
        `for batch in loader` runs the next epoch."""
        return self.epoch(self._position[0])

    @property
    def current_epoch(self) -> int:
        """The epoch the loader is in (or starts next, at an epoch's end)."""
        return self._position[0]

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of `epoch`; after load_state_dict at that epoch, only those not yet delivered."""
        start = self._position[1] if self._position[0] == epoch else 0
        self._position = (epoch, start)
        self._produced, self._busy = 0, 0.0
        if self.workers == 0:
            groups = self._torch_batches(epoch, start, None)
            try:
                for group in self._timed(groups):
                    for batch in group:
                        self._position = (epoch, self._position[1] + 1)
                        yield batch
            finally:
                groups.close()
        else:
            yield from self._from_producer(epoch, start)
        self._position = (epoch + 1, 0)

    def count_epoch(self, epoch: int) -> Iterator[None]:
        """`epoch`'s steps without reading a row, for a rank that reads no data but steps as
        often as the others (a parameter server): None per batch, the position kept as
        `epoch` keeps it (after load_state_dict at that epoch: the steps left)."""
        start = self._position[1] if self._position[0] == epoch else 0
        for batch in range(start, self._steps):
            self._position = (epoch, batch + 1)
            yield None
        self._position = (epoch + 1, 0)

    def _timed(self, groups: Iterator[list]) -> Iterator[list]:
        """`groups` (lists of whole batches), counting the samples and the seconds spent
        producing them (not the time the caller holds them): what epoch_stats reports."""
        while True:
            t = time.perf_counter()
            group = next(groups, None)
            self._busy += time.perf_counter() - t
            if group is None:
                return
            self._produced += len(group) * self.local_batch
            yield group

    def epoch_stats(self) -> dict[str, float]:
        """Of the current or last epoch: samples produced and the seconds spent producing them
        (not counting time blocked on a full queue), so samples_per_s is the loader's capacity."""
        return {
            "samples": self._produced, "busy_s": self._busy,
            "samples_per_s": self._produced / self._busy if self._busy > 0 else 0.0,
        }

    def all_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row of the rank once, in shard and row-group order (evaluation)."""
        units = [(si, g, n) for si, groups in enumerate(self._groups) for g, n in enumerate(groups)]
        pool = ThreadPoolExecutor(self.workers) if self.workers else None
        try:
            chunks = self._shards.decoded(units, pool, self.workers)
            for group in cut_batches(chunks, batch_size, self.rows, partial=True):
                for cols in group:
                    # A view of decoded Arrow memory is read-only; torch wants writable arrays.
                    yield self._to_torch(tuple(c if c.flags.writeable else c.copy() for c in cols))
        finally:
            if pool:
                pool.shutdown(cancel_futures=True)

    # -- the plan --------------------------------------------------------------

    def _plan(self, epoch: int) -> tuple[np.random.Generator, list[tuple[int, int, int]]]:
        """The epoch's generator and its row groups in reading order: (shard, group, rows)."""
        rng = np.random.default_rng([self.seed % 2**64, epoch, self.rank])
        units = []
        for si in rng.permutation(len(self._groups)):
            for g in rng.permutation(len(self._groups[si])):
                units.append((int(si), int(g), self._groups[si][g]))
        return rng, units

    def _torch_batches(self, epoch: int, start: int, pool) -> Iterator[list]:
        """The epoch's batches from batch `start` on, in lists (the batches each chunk completes)."""
        limit = (self._steps - start) * self.local_batch
        chunks = self._chunks(epoch, start * self.local_batch, pool)
        try:
            for group in cut_batches(chunks, self.local_batch, limit, partial=False):
                yield [self._to_torch(cols) for cols in group]
        finally:
            chunks.close()

    def _chunks(self, epoch: int, skip: int, pool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The epoch's sample stream from row `skip` on: the shuffled pass, repeated for `pad`."""
        if self.rows == 0:
            return
        skip %= self.rows  # whole passes skipped (pad) replay identically
        while True:
            yield from self._pass(epoch, skip, pool)
            if self.remainder == "drop":
                return
            skip = 0

    def _pass(self, epoch: int, skip: int, pool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """One shuffled pass over the rank's rows, from row `skip` on."""
        rng, units = self._plan(epoch)
        offsets = np.cumsum([0] + [n for _, _, n in units])
        largest = max(n for _, _, n in units)
        # It never holds more than capacity + one row group, nor more than the pass.
        slots = min(self.shuffle_buffer_rows + largest, self.rows)
        buf = ShuffleBuffer(self.shuffle_buffer_rows, slots, self._shards.layout, warm=WARM_BATCHES * self.local_batch)
        first = 0  # the first row group to decode live
        if skip:
            # Replay the draws on row ids alone until the stream passes `skip`.
            emitted, pending = 0, None
            for p, (_, _, n) in enumerate(units):
                buf.add_ids(offsets[p], n)
                take = buf.draw(rng)
                if take is not None:
                    ids = buf.emit_ids(take)
                    if emitted + len(ids) >= skip:
                        pending, first = ids[skip - emitted :], p + 1
                        break
                    emitted += len(ids)
            else:
                ids = buf.emit_ids(buf.draw(rng, final=True))
                pending, first = ids[skip - emitted :], len(units)
            yield from self._materialise(buf, pending, units, offsets, pool)
        for chunk in self._shards.decoded(units[first:], pool, self.workers):
            buf.add_rows(chunk)
            take = buf.draw(rng)
            if take is not None:
                yield buf.emit_rows(take)
        if buf.n:
            yield buf.emit_rows(buf.draw(rng, final=True))

    def _materialise(self, buf: ShuffleBuffer, pending: np.ndarray, units, offsets, pool):
        """Fill the buffer's slots and the rows `pending` (ids) with their data; yield the latter."""
        need = np.concatenate([buf.ids[: buf.n], pending])
        which = np.searchsorted(offsets, need, side="right") - 1
        wanted = np.unique(which)
        out = tuple(np.empty((len(pending), *c.shape[1:]), c.dtype) for c in buf.cols)
        for p, chunk in zip(wanted, self._shards.decoded([units[p] for p in wanted], pool, self.workers)):
            slots = np.flatnonzero(which[: buf.n] == p)
            rows = buf.ids[slots] - offsets[p]
            rest = np.flatnonzero(which[buf.n :] == p)
            wanted_rows = pending[rest] - offsets[p]
            for col, o, part in zip(buf.cols, out, chunk):
                col[slots] = part[rows]
                o[rest] = part[wanted_rows]
        if len(pending):
            yield out

    # -- reading -----------------------------------------------------------------

    def _to_torch(self, cols: tuple[np.ndarray, ...]):
        if not self._typed and not self.pin_memory:  # tabular on the CPU: two tensors, nothing else
            return torch.from_numpy(cols[0]), torch.from_numpy(cols[1])
        return to_torch(cols, self._shards.inputs, self._typed, self.pin_memory)

    # -- the background producer -------------------------------------------------

    def _from_producer(self, epoch: int, start: int):
        # Batches travel in lists of up to `piece`, at most `prefetch` batches queued: a
        # hand-over is a thread switch (each costs the GIL twice), so fewer of them.
        piece = max(1, self.prefetch // 2)
        q: queue.Queue = queue.Queue(max(1, self.prefetch // piece))
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(epoch, start, q, stop, piece), daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                for batch in item:
                    self._position = (epoch, self._position[1] + 1)
                    yield batch
        finally:
            stop.set()
            thread.join()

    # Called first in the producer thread (collectives.enter_rank_device; a test swaps it).
    on_thread_start = staticmethod(collectives.enter_rank_device)

    def _produce(self, epoch: int, start: int, q: queue.Queue, stop: threading.Event, piece: int) -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="shardline-decode")
        groups = self._torch_batches(epoch, start, pool)
        try:
            # This thread pins the batches: on the rank's GPU, not on GPU 0 (a thread's default).
            self.on_thread_start()
            for group in self._timed(groups):
                for i in range(0, len(group), piece):
                    if not put(group[i : i + piece]):
                        return
            put(_DONE)
        except BaseException as e:  # handed to the consumer, raised in its thread
            put(e)
        finally:
            groups.close()
            pool.shutdown(cancel_futures=True)
