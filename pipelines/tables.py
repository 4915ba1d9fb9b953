"""Delta Lake and Iceberg tables as prepare's input: one version, resolved once on the driver.

The driver opens the table's metadata (delta-rs for Delta's log, pyiceberg for an Iceberg
catalog: pipelines.delta_source, pipelines.iceberg_source), pins a version or snapshot,
and lists that version's live Parquet data files. They become ordinary units
(pipelines.raw) that Spark's and Dask's tasks read with the same pyarrow reader: no task
opens the log or asks for "the latest", so every task reads exactly the version the
driver pinned, and both engines write the same bytes. Each file carries how its columns
become the table's (pipelines.table_files): Delta's partition values, columns the file
predates, Iceberg's field ids.

The version is part of the dataset: the manifest's `sources` record the table and its
version (Delta) or snapshot id (Iceberg), and an append from a later version adds the
rows the versions in between added.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from . import delta_source, iceberg_source
from shardline.foundation import storage
from .config import FeatureSpec, SourceConfig
from shardline.foundation.errors import ConfigError, DataError, first_line
from .raw import RawFile
from .source_config import TABLE_FORMATS
from .sources import display, open_raw
from .table_files import TableFile


@dataclass
class TableInput:
    files: list[RawFile]  # the units' files, each conformed to `schema`
    schema: pa.Schema  # the table's at the pinned version
    source: dict  # the manifest's record: the table and its version
    where: str  # how messages name the table
    pinned: dict  # the settings that pin what was read (a re-check reads the same version)


def where_of(src: SourceConfig) -> str:
    if src.format == "delta":
        return f"Delta table {display(src.path)}"
    return f"Iceberg table {src.table}"


def read_input(src: SourceConfig, previous_sources: list[dict] | None = None) -> TableInput:
    """The table's input at the version `src` pins. previous_sources: a plain append's
    dataset sources: then only the rows added since the version the dataset holds."""
    where = where_of(src)
    if src.format == "delta":
        table = delta_source.open_table(src, where)
        version = table.version()
        where = f"{where} (version {version})"
        delta_source.check_features(table, where)
        schema = delta_source.schema_of(table)
        record = {"format": "delta", "path": display(src.path), "version": version}
        since = _since(previous_sources, record, "version")
        if since is None:
            found = [(url, parts, None) for url, parts, _ in delta_source.live_files(table, src.path)]
        else:
            _check_newer(since, version, where, "version")
            found = delta_source.added(src.path, since, version, schema, where)
            record["since_version"] = since
        files = [_describe(url, schema, lambda _s, p=parts, c=change: TableFile(
            schema, constants=tuple(p.items()), change_type=c)) for url, parts, change in found]
        return TableInput(files, schema, record, where, {"version": version, "timestamp": None})
    table, snapshot = iceberg_source.open_table(src, where)
    sid = snapshot.snapshot_id
    where = f"{where} (snapshot {sid})"
    schema, ids = iceberg_source.schema_of(table, snapshot, src.snapshot_id is not None)
    record = {"format": "iceberg", "table": src.table, "catalog": iceberg_source.catalog_name(src), "snapshot_id": sid}
    since = _since(previous_sources, record, "snapshot_id")
    if since is None:
        found = iceberg_source.data_files(table, snapshot, where)
    else:
        if since == sid:
            _check_newer(since, sid, where, "snapshot")
        found = iceberg_source.added(table, since, snapshot, where)
        record["since_snapshot_id"] = since
    files = [_describe(url, schema, lambda in_file: TableFile(schema, renames=iceberg_source.renames(in_file, ids)))
             for url, _rows in found]
    return TableInput(files, schema, record, where, {"snapshot_id": sid})


def _same_table(a: dict, b: dict) -> bool:
    keys = ("format", "path") if a.get("format") == "delta" else ("format", "table", "catalog")
    return all(a.get(k) == b.get(k) for k in keys)


def _since(previous_sources: list[dict] | None, record: dict, field: str):
    """The newest version of this table the dataset already holds (None: it holds none)."""
    held = [s[field] for s in previous_sources or [] if _same_table(s, record) and field in s]
    return held[-1] if held else None


def _check_newer(since: int, now: int, where: str, what: str) -> None:
    if now == since:
        raise DataError(f"{where}: the dataset holds this {what} already: nothing to append "
                        f"(pin a later one, or prepare without --append)")
    if what == "version" and now < since:
        raise DataError(f"{where}: the dataset holds version {since}, newer than this one; an append "
                        "only adds a later version's rows")


def _describe(url: str, schema: pa.Schema, table_file) -> RawFile:
    """A table's data file as a unit source: its row groups from the footer; table_file(the
    file's own schema) says how it reads as the table's rows."""
    try:
        with open_raw(url) as f:
            meta = pq.read_metadata(f)
    except FileNotFoundError:
        raise DataError(f"{display(url)}: a data file the table lists is missing (removed by a VACUUM?)") from None
    except Exception as e:
        raise DataError(f"{display(url)}: not a readable Parquet file ({first_line(e)})") from None
    rgs = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return RawFile(url, "parquet", schema, rgs, table=table_file(meta.schema.to_arrow_schema()))


def check_columns(spec: FeatureSpec, ti: TableInput) -> None:
    """Every column the spec names is the table's: one ConfigError line naming the table."""
    required = [spec.label, *(spec.numeric or []), *(spec.categorical or []), *spec.vectors, *spec.tensors,
                *spec.images]
    if not spec.generate_key:
        required.insert(0, spec.key)
    for col in required:
        if col is not None and col not in ti.schema.names:
            raise ConfigError(f"{ti.where}: column '{col}' not found (the table's columns: "
                              f"{', '.join(ti.schema.names)})")
    if not ti.files:
        raise DataError(f"{ti.where}: no rows to read" + (" (the versions since the dataset's added none)"
                                                           if any(k.startswith("since") for k in ti.source) else ""))


# -- re-reading a dataset's sources (prepare --append --refit) --------------------------------


def previous_inputs(sources: list[dict], src: SourceConfig, delimiter: str) -> tuple[list[RawFile], list[dict]]:
    """The files of every source a dataset lists, to prepare again with the new one; a table
    the new source reads at a later version is left out (that version holds its rows)."""
    from .raw import describe

    current = read_record(src)
    files: list[RawFile] = []
    kept: list[dict] = []
    for s in sources:
        fmt = str(s.get("format"))
        if fmt in TABLE_FORMATS:
            if current is not None and _same_table(s, current):
                continue
            pinned = _source_of(s, src)
            again = read_input(pinned)
            files += again.files
            kept.append(again.source)
        elif fmt in ("table", "dataframe"):
            what = f"the Spark query {s.get('query')!r}" if s.get("query") else \
                f"the Spark table {s['table']!r}" if s.get("table") else "a DataFrame given to prepare()"
            raise DataError(f"--refit re-reads every source of the dataset, and one of them was {what}, which "
                            "cannot be read again as it was; prepare the whole data anew (without --append)")
        else:
            path = str(s["path"])
            files += describe([path if "://" in path else f"file://{path}"], fmt, delimiter)
            kept.append(s)
    return files, kept


def read_record(src: SourceConfig) -> dict | None:
    """The identity part of the record a table source will write (no version): for matching."""
    if src.format == "delta":
        return {"format": "delta", "path": display(src.path)}
    if src.format == "iceberg":
        return {"format": "iceberg", "table": src.table, "catalog": iceberg_source.catalog_name(src)}
    return None


def _source_of(record: dict, src: SourceConfig) -> SourceConfig:
    """A dataset's table source, to read again at the version it recorded."""
    if record["format"] == "delta":
        path = str(record["path"])
        return SourceConfig(format="delta", path=path if "://" in path else storage.resolve(path, "sources"),
                            version=int(record["version"]))
    if src.format != "iceberg" or iceberg_source.catalog_name(src) != record.get("catalog"):
        raise DataError(f"--refit: the dataset's source Iceberg table {record['table']} is in catalog "
                        f"{record.get('catalog')!r}; give that catalog in pipelines.source.catalog to read it again")
    return SourceConfig(format="iceberg", table=str(record["table"]), catalog=dict(src.catalog),
                        snapshot_id=int(record["snapshot_id"]))


def describe_sources(sources: list[dict]) -> list[tuple[str, str]]:
    """(name, URL or table) of each table a dataset was prepared from, for tracking:
    `delta:<path>@v<version>`, `iceberg:<table>@<snapshot id>`, `spark:<table or query>`."""
    out = []
    for s in sources:
        fmt = s.get("format")
        if fmt == "delta":
            out.append((f"delta:{s['path']}@v{s['version']}", str(s["path"])))
        elif fmt == "iceberg":
            out.append((f"iceberg:{s['table']}@{s['snapshot_id']}", str(s["table"])))
        elif fmt == "table":
            what = str(s.get("table") or s.get("query"))
            out.append((f"spark:{what}"[:500], what[:500]))
    return out
