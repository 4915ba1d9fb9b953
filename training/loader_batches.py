"""The loader's two row movers: the shuffle buffer (which rows leave next, decided from
counts alone so a resume can replay it) and the re-cutting of chunks into batches."""

from __future__ import annotations

import numpy as np


class ShuffleBuffer:
    """Row slots [0, n): `draw` decides from counts alone which slots leave next;
    `emit_*` hands them out and fills the holes below the new size with the kept
    rows above it.

    Replaying draws for a resume moves row ids only (`add_ids`/`emit_ids`); reading
    live moves the rows only (`add_rows`/`emit_rows`): ids kept alongside would cost
    ~8% of an epoch and nothing reads them. `ShardLoader._materialise` turns a
    replayed buffer live by filling its slots from their ids.
    """

    def __init__(self, capacity: int, slots: int, width: int, y_dtype):
        self.capacity, self.n = capacity, 0
        self.ids = np.empty(slots, np.int64)
        self.x = np.empty((slots, width), np.float32)
        self.y = np.empty(slots, y_dtype)
        # Rows as single items: scattering them is several times faster than 2-D fancy indexing.
        self._rows = self.x.view(np.dtype((np.void, 4 * width))).reshape(slots)

    def add_ids(self, first_id: int, rows: int) -> None:
        self.ids[self.n : self.n + rows] = np.arange(first_id, first_id + rows)
        self.n += rows

    def add_rows(self, x: np.ndarray, y: np.ndarray) -> None:
        a, b = self.n, self.n + len(y)
        self.x[a:b], self.y[a:b] = x, y
        self.n = b

    def draw(self, rng: np.random.Generator, final: bool = False) -> np.ndarray | None:
        if final:
            return rng.permutation(self.n)
        over = self.n - self.capacity
        return rng.choice(self.n, size=over, replace=False) if over > 0 else None

    def emit_ids(self, take: np.ndarray) -> np.ndarray:
        ids = self.ids[take]
        holes, movers = self._refill(take)
        self.ids[holes] = self.ids[movers]
        return ids

    def emit_rows(self, take: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = np.take(self.x, take, axis=0), self.y[take]
        holes, movers = self._refill(take)
        self._rows[holes], self.y[holes] = self._rows[movers], self.y[movers]
        return out

    def _refill(self, take: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shrink to n - len(take): the holes below it and the kept slots above it that fill them."""
        keep = self.n - len(take)
        gone = np.zeros(self.n, bool)
        gone[take] = True
        self.n = keep
        return np.flatnonzero(gone[:keep]), keep + np.flatnonzero(~gone[keep:])


def cut_batches(chunks, batch: int, limit: int, partial: bool):
    """Re-cut (x, y) chunks into batches of `batch` rows, `limit` rows in all.

    Whole batches inside a chunk are views of it; only a batch that straddles
    two chunks is copied.
    """
    carry_x: list = []
    carry_y: list = []
    have = 0
    try:
        if limit <= 0:
            return
        for x, y in chunks:
            if len(y) > limit:
                x, y = x[:limit], y[:limit]
            limit -= len(y)
            i = 0
            if have:
                i = min(batch - have, len(y))
                carry_x.append(x[:i])
                carry_y.append(y[:i])
                have += i
                if have < batch:
                    if limit == 0:
                        break
                    continue
                yield np.concatenate(carry_x), np.concatenate(carry_y)
                carry_x, carry_y, have = [], [], 0
            while i + batch <= len(y):
                yield x[i : i + batch], y[i : i + batch]
                i += batch
            if i < len(y):
                carry_x, carry_y, have = [x[i:]], [y[i:]], len(y) - i
            if limit == 0:
                break  # before asking for another chunk: it may start a whole new pass
        if have and partial:
            yield np.concatenate(carry_x), np.concatenate(carry_y)
    finally:
        chunks.close()
