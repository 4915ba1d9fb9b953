"""Raw data for `shardline bench scale` and `bench shapes`: generated once, kept for reruns.

The quickstart's synthetic schema (pipelines.synthetic: key, x0..x7, color, label) written
as CSV, ROWS_PER_FILE rows a file, floats to 5 decimals (~85 bytes a row: 300M rows are
~25 GB), by one process per core. A folder holds a marker with what it holds; a folder
with the same marker is used as it is, one with another is refused, never replaced.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from shardline.foundation.errors import DataError
from shardline.pipelines.config import SyntheticSource

MARKER = "_bench_data.json"
ROWS_PER_FILE = 1 << 20  # one prepare unit a file (pipelines.raw.UNIT_ROWS)
CHUNK = 100_000
DECIMALS = 5
QUICKSTART = SyntheticSource(rows=1, numeric_features=8, categories=6, classes=3, seed=7)


def raw_folder(data_dir: str | Path, name: str, spec: dict, write_file, files: int, progress=print,
               cores: int | None = None) -> Path:
    """data_dir/name holding `files` files written by write_file(folder, i) (a module-level
    function: it runs in another process); generated unless the marker says it holds `spec`."""
    folder = Path(data_dir).resolve() / name
    marker = folder / MARKER
    if marker.exists():
        if json.loads(marker.read_text()) == spec:
            progress(f"raw data: {folder} (kept from an earlier run)")
            return folder
        raise DataError(f"{folder}: holds other bench data ({marker.read_text().strip()}); remove it or "
                        "choose another --data-dir")
    if folder.exists() and any(folder.iterdir()):
        raise DataError(f"{folder}: exists and is not bench data; choose another --data-dir")
    folder.mkdir(parents=True, exist_ok=True)
    progress(f"generating raw data into {folder} ({files:,} file(s), once)")
    cores = cores or len(os.sched_getaffinity(0))
    with ProcessPoolExecutor(cores) as pool:
        for done in pool.map(write_file, [str(folder)] * files, range(files), chunksize=max(1, files // (cores * 8))):
            del done
    marker.write_text(json.dumps(spec))  # last: a folder without it is an interrupted generate
    return folder


def quickstart_csv(data_dir: str | Path, rows: int, progress=print, rows_per_file: int = ROWS_PER_FILE,
                   name: str | None = None) -> Path:
    """`rows` rows of the quickstart's schema as CSV files of `rows_per_file` rows."""
    files = math.ceil(rows / rows_per_file)
    spec = {"kind": "quickstart-csv", "rows": rows, "rows_per_file": rows_per_file, "decimals": DECIMALS}
    from functools import partial

    write = partial(_write_quickstart, rows=rows, rows_per_file=rows_per_file)
    return raw_folder(data_dir, name or f"raw-{rows}", spec, write, files, progress)


def _write_quickstart(folder: str, i: int, rows: int, rows_per_file: int) -> str:
    start, stop = i * rows_per_file, min((i + 1) * rows_per_file, rows)
    path = os.path.join(folder, f"part-{i:06d}.csv")
    with pcsv.CSVWriter(path + ".tmp", _schema()) as w:
        for a in range(start, stop, CHUNK):
            w.write_table(quickstart_rows(a, min(a + CHUNK, stop)))
    os.replace(path + ".tmp", path)  # a file is there whole or not at all
    return path


def quickstart_rows(start: int, stop: int) -> pa.Table:
    from shardline.pipelines.synthetic import generate_rows

    df = generate_rows(start, stop, QUICKSTART)
    for c in df.columns:
        if df[c].dtype == np.float64:
            df[c] = df[c].round(DECIMALS)
    return pa.Table.from_pandas(df, preserve_index=False)


def _schema() -> pa.Schema:
    return quickstart_rows(0, 1).schema


def folder_bytes(folder: str | Path) -> int:
    """Bytes of the files under `folder`."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
