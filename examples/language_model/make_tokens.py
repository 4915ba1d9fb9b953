"""Generated token sequences as a Parquet table (`id`, `tokens`: a list of int32 ids), the
layout of a tokenised corpus. Each sequence counts up from a random start, wrapping
within the vocabulary (ids 1..vocab-1; 0 is the pad), with 8 to 24 ids, so a small
decoder learns to predict the next id. Nothing is downloaded."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def sequences(rows: int, vocab: int = 32, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        start, length = int(rng.integers(1, vocab)), int(rng.integers(8, 25))
        out.append([(start - 1 + i) % (vocab - 1) + 1 for i in range(length)])
    return out


def write_tokens(folder, rows: int = 512, files: int = 2, seed: int = 0) -> Path:
    """`rows` sequences in `files` Parquet files under `folder`; the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": pa.array(range(rows), pa.int64()),
                      "tokens": pa.array(sequences(rows, seed=seed), pa.list_(pa.int32()))})
    for i, part in enumerate(np.array_split(np.arange(rows), files)):
        pq.write_table(table.take(pa.array(part)), folder / f"part-{i}.parquet")
    return folder


if __name__ == "__main__":
    print(write_tokens(sys.argv[1] if len(sys.argv) > 1 else "example-out/tokens"))
