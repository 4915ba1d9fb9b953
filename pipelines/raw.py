"""Raw input as Arrow: the units of work and the one reader both engines run in their tasks.

The driver describes the files (Parquet footers, CSV headers, first JSON lines),
cuts them into units (a Parquet file's row groups in runs of about UNIT_ROWS rows;
a CSV or JSON file whole) and hands the same unit list to Spark or Dask. Inside a
task, `read_unit` yields the unit's rows in a fixed sequence of Arrow batches.
Both engines therefore see the same bytes cut the same way, which is what makes
their reports, statistics and first errors identical. No engine reader is used:
Spark's would need Hadoop's jars for object stores, and it reads CSV and JSON
values differently from any Python reader.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from shardline.foundation import storage
from shardline.foundation.errors import DataError, first_line
from .sources import display, open_raw
from .table_files import TableFile

# A unit is read, parsed and reported as one task; ~1M rows keep a task's memory
# near 100-200 MB and give a big Parquet file several tasks.
UNIT_ROWS = 1 << 20
# ...and at most this many bytes of Parquet values (uncompressed): 1M rows of a
# 2,048-float vector would be 8 GB, parsed to float64 twice that.
UNIT_BYTES = 128 << 20
# CSV and JSON files are read in blocks of this many bytes (one Arrow batch each).
TEXT_BLOCK_BYTES = 64 << 20
# Rows the driver reads to infer which CSV/JSON columns are numeric.
SNIFF_ROWS = 1000
# Files the driver describes at once: a footer or a header is a round trip (a request on
# an object store), so threads overlap them; 100,000 small CSV files took 82 s one by one
# here, most of it waiting.
DESCRIBE_THREADS = 16
DESCRIBE_CHUNK = 256
# Bytes read to find a CSV file's header line.
HEADER_BYTES = 64 << 10


@dataclass(frozen=True)
class RawFile:
    url: str
    fmt: str
    schema: pa.Schema  # Parquet: the file's; CSV and JSON: every column text
    row_groups: tuple[int, ...] = ()  # rows per row group (Parquet only)
    files: tuple[str, ...] = ()  # the images source: its image files (url is its folder)
    table: TableFile | None = None  # a Delta or Iceberg data file: its columns as the table's
    size: int = 0  # bytes (CSV and JSON: what a unit's rows are estimated from)
    row_bytes: int = 0  # Parquet: uncompressed bytes of a row (its footer's sizes)


@dataclass(frozen=True)
class Unit:
    """Rows of one file: all of it, or row groups [first, first + count) of a Parquet file."""

    index: int
    url: str
    fmt: str
    first_row_group: int = 0
    row_groups: int = 0
    first_row: int = 0  # of the file: error messages name rows in the file
    files: tuple[str, ...] = ()  # the images source: this unit's image files
    table: TableFile | None = None  # a table's data file (pipelines.table_files)
    # Rows: counted for Parquet (its footer), guessed from the bytes for CSV and JSON (0:
    # unknown); bytes: the file's for CSV and JSON, uncompressed values for Parquet. What
    # pipelines.unit_groups deals units into tasks by and pipelines.chunks joins them by.
    rows: int = 0
    bytes: int = 0
    batch_rows: int = UNIT_ROWS  # Parquet: rows per batch read (at most UNIT_BYTES of them)


# A CSV or JSON row is rarely shorter than this: rows guessed from bytes err high, so a
# task of guessed rows holds at most what a task of counted rows would.
TEXT_ROW_BYTES = 64


def describe(files: list[str], fmt: str, delimiter: str) -> list[RawFile]:
    """Each file's columns (and Parquet row groups), from its footer or first lines.

    Names the first file that cannot be read as its format. The images source is one
    RawFile: its folder, with every image file in it.
    """
    if fmt == "images":
        from .images import IMAGE_SCHEMA, SUFFIXES, class_files

        if len(files) == 1 and not files[0].lower().endswith(SUFFIXES):  # the folder (a source of old)
            files = class_files(files[0], display(files[0]))
        root = files[0].rsplit("/", 2)[0]  # files are <root>/<class>/<name>
        return [RawFile(root, fmt, IMAGE_SCHEMA, files=tuple(files))]
    schemas: dict[str, pa.Schema] = {}  # one object per distinct schema, not one per file

    def one(url: str) -> RawFile | Exception:
        try:
            return _describe_one(url, fmt, delimiter, schemas)
        except Exception as e:  # the reader's own error, whatever the library
            return e

    # Slices, not a future per file: 100,000 futures (a lock and a condition each) left
    # ~150 MB of freed but fragmented memory on the driver.
    chunks = [files[i : i + DESCRIBE_CHUNK] for i in range(0, len(files), DESCRIBE_CHUNK)]
    with ThreadPoolExecutor(min(DESCRIBE_THREADS, max(1, len(chunks)))) as pool:
        out = [f for chunk in pool.map(lambda c: [one(u) for u in c], chunks) for f in chunk]
    for url, f in zip(files, out):  # the first unreadable file in file order
        if isinstance(f, Exception):
            what = "not a readable Parquet file" if _parquet(fmt) else f"not readable {fmt}"
            raise DataError(f"{display(url)}: {what} ({first_line(f)})") from None
    return out


def _describe_one(url: str, fmt: str, delimiter: str, schemas: dict[str, pa.Schema]) -> RawFile:
    if _parquet(fmt):
        with open_raw(url) as f:
            meta = pq.read_metadata(f)
        rgs = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        values = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        return RawFile(url, fmt, _shared(meta.schema.to_arrow_schema(), schemas), rgs,
                       row_bytes=-(-values // max(1, sum(rgs))))
    size = storage.size(url)
    if fmt == "csv":
        # The header is all a CSV file's columns are (every value is text); the driver
        # parses rows of the first file only (checks._kinds).
        schema = pa.schema([(n, pa.string()) for n in csv_header(url, delimiter)])
    else:
        schema = sniff(url, fmt, delimiter).schema
    return RawFile(url, fmt, _shared(schema, schemas), size=size)


def _shared(schema: pa.Schema, schemas: dict[str, pa.Schema]) -> pa.Schema:
    """The schema object describing files of this schema (dict.setdefault is atomic
    under the GIL: threads may race to add the same schema, one object wins)."""
    return schemas.setdefault(schema.to_string(show_schema_metadata=False), schema)


def csv_header(url: str, delimiter: str) -> list[str]:
    """A CSV file's column names: its first line, read with no more than HEADER_BYTES."""
    with open_raw(url) as f:
        head = b""
        while b"\n" not in head and len(head) < HEADER_BYTES:
            chunk = f.read(HEADER_BYTES - len(head))
            if not chunk:
                break
            head += chunk
    line = head.split(b"\n", 1)[0].decode("utf-8-sig").rstrip("\r")
    return next(csv.reader([line], delimiter=delimiter), [])


def plan_units(described: list[RawFile]) -> list[Unit]:
    """Units in file order, then row order: the order every merge and first error follows."""
    units: list[Unit] = []
    for f in described:
        fmt = f.fmt
        if fmt == "images":
            from .images import UNIT_FILES

            for i in range(0, len(f.files), UNIT_FILES):
                units.append(Unit(len(units), f.url, fmt, first_row=i, files=f.files[i : i + UNIT_FILES]))
            continue
        if not _parquet(fmt):
            units.append(Unit(len(units), f.url, fmt, rows=f.size // TEXT_ROW_BYTES, bytes=f.size))
            continue
        # Runs of whole row groups of about UNIT_ROWS rows (fewer, wide ones: UNIT_BYTES); a
        # file with none is one empty unit.
        most = max(1, min(UNIT_ROWS, UNIT_BYTES // max(1, f.row_bytes)))
        runs: list[list[int]] = [[]]
        held = 0
        for i, n in enumerate(f.row_groups):
            if runs[-1] and held + n > most:
                runs.append([])
                held = 0
            runs[-1].append(i)
            held += n
        first_row = 0
        for run in runs:
            first = run[0] if run else 0
            rows = sum(f.row_groups[j] for j in run)
            units.append(Unit(len(units), f.url, fmt, first, len(run), first_row, table=f.table, rows=rows,
                              bytes=rows * f.row_bytes, batch_rows=most))
            first_row += rows
    return units


def read_unit(unit: Unit, columns: list[str], delimiter: str) -> Iterator[pa.Table]:
    """The unit's rows, `columns` only, as a fixed sequence of tables.

    CSV values all come as text (nothing is made null or converted here: the row
    code applies `null_values` and number parsing, the same for every format).
    JSON scalars come as their JSON text too, lists as lists.
    """
    if unit.fmt == "images":
        from .images import read_images

        yield read_images(unit.url, unit.files, columns)
    elif _parquet(unit.fmt):
        conform = (lambda t: unit.table.conform(t, columns)) if unit.table is not None else (lambda t: t)
        with open_raw(unit.url) as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            present = unit.table.file_columns(columns, names) if unit.table is not None else \
                [c for c in columns if c in names]
            groups = list(range(unit.first_row_group, unit.first_row_group + unit.row_groups))
            if not groups:
                yield conform(pf.schema_arrow.empty_table().select(present))
                return
            for batch in pf.iter_batches(batch_size=unit.batch_rows, row_groups=groups, columns=present,
                                         use_threads=False):
                yield conform(pa.Table.from_batches([batch]))
    elif unit.fmt == "csv":
        with _lines(unit.url) as f:
            yield from _csv_tables(f, columns, delimiter)
    else:
        with _lines(unit.url) as f:
            yield from _json_tables(f, columns)


def _lines(url: str) -> io.BufferedReader:
    """A text file read forward, line by line: pyarrow's files (what `open_raw` returns
    on every store) have no readline, and a decompressing stream cannot seek."""
    return io.BufferedReader(open_raw(url), buffer_size=1 << 20)


def sniff(url: str, fmt: str, delimiter: str, rows: int = SNIFF_ROWS) -> pa.Table:
    """The first rows of a raw file, every column, read as in tasks (for the driver's checks)."""
    with open_raw(url) if _parquet(fmt) else _lines(url) as f:
        if _parquet(fmt):
            pf = pq.ParquetFile(f)
            batch = next(pf.iter_batches(batch_size=rows), None)
            return pa.Table.from_batches([batch]) if batch is not None else pf.schema_arrow.empty_table()
        if fmt == "csv":
            # Only the head of the file, never the whole file.
            head = f.read(1 << 20)
            text = head[: head.rfind(b"\n") + 1] if b"\n" in head else head
            tables = list(_csv_tables(io.BufferedReader(io.BytesIO(text)), None, delimiter))
            return tables[0].slice(0, rows) if tables else pa.table({})
        return next(_json_tables(f, None, limit=rows), pa.table({}))


def _csv_tables(f, columns: list[str] | None, delimiter: str) -> Iterator[pa.Table]:
    """`f` read forward from its start: the header line here, the rows by pyarrow."""
    header = f.readline().decode("utf-8-sig").rstrip("\r\n")
    names = next(csv.reader([header], delimiter=delimiter), [])
    included = [c for c in columns if c in names] if columns is not None else None
    if not f.peek(1):  # a header and no rows (pyarrow calls that an empty file)
        yield pa.table({n: pa.array([], pa.string()) for n in (names if included is None else included)})
        return
    reader = pcsv.open_csv(
        f,
        read_options=pcsv.ReadOptions(block_size=TEXT_BLOCK_BYTES, use_threads=False, column_names=names),
        parse_options=pcsv.ParseOptions(delimiter=delimiter),
        convert_options=pcsv.ConvertOptions(
            column_types={n: pa.string() for n in names},
            null_values=[],
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
            include_columns=included,
        ),
    )
    empty = True
    for batch in reader:
        empty = False
        yield pa.Table.from_batches([batch])
    if empty:
        yield reader.schema.empty_table()


def _json_tables(f, columns: list[str] | None, limit: int | None = None) -> Iterator[pa.Table]:
    """JSON lines, in blocks of lines, every value as its JSON text (strings as they are).

    Python's json, not pyarrow's: pyarrow refuses a column whose values change type (a
    number, then text), which is exactly the bad input the row code reports row by row.
    As text, a JSON value parses like the same value in a CSV file.
    """
    names: list[str] = list(columns) if columns is not None else []
    rows: list[dict] = []
    size = 0
    for line_no, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise DataError(f"line {line_no}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise DataError(f"line {line_no}: not a JSON object")
        if columns is None:
            names.extend(k for k in obj if k not in names)
        rows.append(obj)
        size += len(line)
        if limit is not None and len(rows) >= limit:
            break
        if size >= TEXT_BLOCK_BYTES:
            yield _json_table(rows, names)
            rows, size = [], 0
    if rows or size == 0:
        yield _json_table(rows, names)


def _json_table(rows: list[dict], names: list[str]) -> pa.Table:
    return pa.table({c: pa.array([_json_text(r.get(c)) for r in rows], pa.string()) for c in names})


def _json_text(v) -> str | None:
    if v is None:
        return None
    return v if isinstance(v, str) else json.dumps(v)


def _parquet(fmt: str) -> bool:
    return fmt in ("parquet", "synthetic")
