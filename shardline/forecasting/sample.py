"""The forecast's sample: the head of the user's raw data, copied as it is (format, file
sizes up to the sample's rows), then prepared in this process by prepare's own code.

Copying keeps what decides a prepare's cost per row: the format's parsing, the columns,
and the files' shape (a sample of 100,000 small files is many small files too, so the
per-file cost is in the per-row figure). The whole input is only listed and described,
as prepare's driver does.
"""

from __future__ import annotations

import io
import os

import pyarrow.parquet as pq

from shardline.foundation.errors import ConfigError
from shardline.pipelines.config import SourceConfig
from shardline.pipelines.raw import RawFile
from shardline.pipelines.sources import open_raw

SAMPLE_ROWS = 300_000  # a few seconds of prepare on one core
FORMATS = ("csv", "json", "parquet", "synthetic")


def check_source(src: SourceConfig) -> None:
    if src.format not in FORMATS:
        raise ConfigError(f"pipelines.source.format = '{src.format}': the forecast samples "
                          f"{', '.join(FORMATS)} sources")


def copy_head(files: list[RawFile], fmt: str, rows: int, out_dir: str) -> tuple[int, int]:
    """The first `rows` rows of `files`, in file order, as files of the same format under
    `out_dir` (a local folder): whole files while they fit, the head of the last one.
    (rows copied, files copied)."""
    os.makedirs(out_dir, exist_ok=True)
    copied = n = 0
    for n, f in enumerate(files, start=1):
        path = os.path.join(out_dir, f"sample-{n:06d}.{'parquet' if fmt != 'json' and fmt != 'csv' else fmt}")
        copied += (_parquet_head if fmt in ("parquet", "synthetic") else _text_head)(f, rows - copied, path, fmt)
        if copied >= rows:
            break
    return copied, n


def _parquet_head(f: RawFile, rows: int, path: str, fmt: str) -> int:
    with open_raw(f.url) as src:
        pf = pq.ParquetFile(src)
        taken, groups = 0, []
        for i, n in enumerate(f.row_groups):
            if taken >= rows:
                break
            groups.append(i)
            taken += n
        table = pf.read_row_groups(groups) if groups else pf.schema_arrow.empty_table()
    table = table.slice(0, rows)
    pq.write_table(table, path, row_group_size=max(1, f.row_groups[0] if f.row_groups else 1))
    return table.num_rows


def _text_head(f: RawFile, rows: int, path: str, fmt: str) -> int:
    """Lines of a CSV (its header, then `rows` rows) or JSON-lines file, decompressed."""
    taken = 0
    with io.BufferedReader(open_raw(f.url), buffer_size=1 << 20) as src, open(path, "wb") as out:
        if fmt == "csv":
            out.write(src.readline())
        for line in src:
            if taken >= rows:
                break
            out.write(line)
            taken += 1 if line.strip() else 0
    return taken


def synthetic_head(src: SourceConfig, rows: int, out_dir: str) -> int:
    """A synthetic source's first rows, as the Parquet file it would generate."""
    import pyarrow as pa

    from shardline.pipelines.synthetic import generate_rows

    os.makedirs(out_dir, exist_ok=True)
    n = min(rows, src.synthetic.rows)
    with pq.ParquetWriter(os.path.join(out_dir, "part-00000.parquet"),
                          pa.Schema.from_pandas(generate_rows(0, 1, src.synthetic), preserve_index=False)) as w:
        for a in range(0, n, 100_000):  # row groups as synthetic.generate writes them
            w.write_table(pa.Table.from_pandas(generate_rows(a, min(a + 100_000, n), src.synthetic),
                                               preserve_index=False))
    return n
