"""The loader's two row movers: the shuffle buffer (which rows leave next, decided from
counts alone so a resume can replay it) and the re-cutting of chunks into batches.

A chunk is a tuple of column arrays of equal length (the inputs, then the label): (x, y)
for tabular data, one array per tensor or image column otherwise."""

from __future__ import annotations

import numpy as np


class ShuffleBuffer:
    """Row slots [0, n): `draw` decides from counts alone which slots leave next;
    `emit_*` hands them out and fills the holes below the new size with the kept
    rows above it.

    A pass starts emitting once the buffer holds `warm` rows, then keeps
    max(warm, rows added / GROWTH) of them, up to `capacity`: the first batch waits for
    `warm` rows, not for a whole buffer (65,536 rows, or an epoch of a rank's images
    decoded before its first step), and while the buffer grows it still passes on
    (GROWTH - 1) / GROWTH of what it reads, so loading keeps pace with training.

    Replaying draws for a resume moves row ids only (`add_ids`/`emit_ids`); reading
    live moves the rows only (`add_rows`/`emit_rows`): ids kept alongside would cost
    ~8% of an epoch and nothing reads them. `ShardLoader._materialise` turns a
    replayed buffer live by filling its slots from their ids.
    """

    GROWTH = 8

    def __init__(self, capacity: int, slots: int, layout: list[tuple[tuple[int, ...], np.dtype]],
                 warm: int | None = None):
        """layout: (row shape, dtype) per column of the chunks; warm: rows held before the first
        emission (None: capacity, a buffer that fills before it emits)."""
        self.capacity, self.n, self.added = capacity, 0, 0
        self.warm = capacity if warm is None else min(warm, capacity)
        self.ids = np.empty(slots, np.int64)
        self.cols = [np.empty((slots, *shape), dtype) for shape, dtype in layout]
        # Rows as single items: scattering them is several times faster than 2-D fancy indexing.
        self._rows = [
            c.reshape(slots, -1).view(np.dtype((np.void, c[:1].nbytes))).reshape(slots) if c.ndim > 1 else c
            for c in self.cols
        ]

    def add_ids(self, first_id: int, rows: int) -> None:
        self.ids[self.n : self.n + rows] = np.arange(first_id, first_id + rows)
        self.n += rows
        self.added += rows

    def add_rows(self, chunk: tuple[np.ndarray, ...]) -> None:
        a, b = self.n, self.n + len(chunk[-1])
        for col, part in zip(self.cols, chunk):
            col[a:b] = part
        self.n = b
        self.added += b - a

    def draw(self, rng: np.random.Generator, final: bool = False) -> np.ndarray | None:
        if final:
            return rng.permutation(self.n)
        keep = min(self.capacity, max(self.warm, self.added // self.GROWTH))
        over = self.n - keep
        return rng.choice(self.n, size=over, replace=False) if over > 0 else None

    def emit_ids(self, take: np.ndarray) -> np.ndarray:
        ids = self.ids[take]
        holes, movers = self._refill(take)
        self.ids[holes] = self.ids[movers]
        return ids

    def emit_rows(self, take: np.ndarray) -> tuple[np.ndarray, ...]:
        out = tuple(np.take(c, take, axis=0) for c in self.cols)
        holes, movers = self._refill(take)
        for rows in self._rows:
            rows[holes] = rows[movers]
        return out

    def _refill(self, take: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shrink to n - len(take): the holes below it and the kept slots above it that fill them."""
        keep = self.n - len(take)
        gone = np.zeros(self.n, bool)
        gone[take] = True
        self.n = keep
        return np.flatnonzero(gone[:keep]), keep + np.flatnonzero(~gone[keep:])


def cut_batches(chunks, batch: int, limit: int, partial: bool):
    """Re-cut chunks (tuples of column arrays) into batches of `batch` rows, `limit` rows in all.

    Yields, for each chunk read, the list of batches it completes (maybe none): the
    loader hands them to the training thread a list at a time, one thread switch per
    chunk, not per batch. Whole batches inside a chunk are views of it; only a batch that
    straddles two chunks is copied.
    """
    carry: list[tuple] = []
    have = 0

    def joined():
        return tuple(np.concatenate(parts) for parts in zip(*carry))

    try:
        if limit <= 0:
            return
        for chunk in chunks:
            n = len(chunk[-1])
            if n > limit:
                chunk, n = tuple(c[:limit] for c in chunk), limit
            limit -= n
            i = 0
            out = []
            if have:
                i = min(batch - have, n)
                carry.append(tuple(c[:i] for c in chunk))
                have += i
                if have < batch:
                    if limit == 0:
                        break
                    continue
                out.append(joined())
                carry, have = [], 0
            if len(chunk) == 2:  # tabular (x, y): the common case without a loop over columns
                x, y = chunk
                out += [(x[j : j + batch], y[j : j + batch]) for j in range(i, n - batch + 1, batch)]
            else:
                out += [tuple(c[j : j + batch] for c in chunk) for j in range(i, n - batch + 1, batch)]
            i += (n - i) // batch * batch
            if i < n:
                carry, have = [tuple(c[i:] for c in chunk)], n - i
            if out:
                yield out
            if limit == 0:
                break  # before asking for another chunk: it may start a whole new pass
        if have and partial:
            yield [joined()]
    finally:
        chunks.close()
