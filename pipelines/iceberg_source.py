"""An Apache Iceberg table as prepare's input, through pyiceberg, on the driver only.

The catalog (its properties are `pipelines.source.catalog`) is opened once; one snapshot
is pinned (`snapshot_id`, else the current one) and its scan planned into data files.
Tasks read those Parquet files by URL and never open the catalog. Delete files (position
or equality deletes) and data files in another format are refused by name: a plain read
of the data files would bring deleted rows back.
"""

from __future__ import annotations

import os

import pyarrow as pa

from shardline.foundation.errors import ConfigError, DataError, first_line
from .source_config import SourceConfig

FIELD_ID = b"PARQUET:field_id"


def open_table(src: SourceConfig, where: str):
    """(table, snapshot) for `src`; one ConfigError line when the catalog cannot be reached,
    the table is not in it, or the snapshot is unknown."""
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    props = {k: str(v) for k, v in src.catalog.items()}
    name = props.pop("name", "default")
    _check_sqlite(props)
    if _is_sql(props):
        props.setdefault("init_catalog_tables", "false")  # reading never creates a catalog's tables
    try:
        catalog = load_catalog(name, **props)
    except Exception as e:
        raise ConfigError(f"pipelines.source.catalog: cannot open the Iceberg catalog ({first_line(e)})") from None
    try:
        try:
            table = catalog.load_table(src.table)
        except (NoSuchTableError, NoSuchNamespaceError):
            # A SQL catalog keeps each table under the catalog name it was made with: with no
            # name given, the one name the catalog holds this table under.
            other = _sql_catalog_name(props, src.table) if "name" not in src.catalog else None
            if other is None:
                raise
            name, catalog = other, load_catalog(other, **props)
            table = catalog.load_table(src.table)
    except (NoSuchTableError, NoSuchNamespaceError):
        raise ConfigError(f"{where}: no such table in catalog {name!r} (pipelines.source.table; a SQL catalog "
                          "keeps tables per catalog name: pipelines.source.catalog.name, default 'default')") from None
    except Exception as e:
        raise ConfigError(f"pipelines.source.catalog: cannot reach the Iceberg catalog ({first_line(e)})") from None
    if src.snapshot_id is not None:
        snapshot = table.snapshot_by_id(src.snapshot_id)
        if snapshot is None:
            have = ", ".join(str(s.snapshot_id) for s in table.snapshots()[-5:]) or "none"
            raise ConfigError(f"{where}: pipelines.source.snapshot_id = {src.snapshot_id}: no such snapshot "
                              f"(the table's latest: {have})")
    else:
        snapshot = table.current_snapshot()
        if snapshot is None:
            raise DataError(f"{where}: the table has no snapshot yet (no data was ever written to it)")
    return table, snapshot


def _is_sql(props: dict) -> bool:
    """A SQL catalog: said so, or (as pyiceberg infers it) a SQLite or PostgreSQL uri."""
    kind = props.get("type")
    return kind == "sql" or (kind is None and str(props.get("uri", "")).startswith(("sqlite", "postgresql")))


def _sql_catalog_name(props: dict, table: str) -> str | None:
    """The catalog name a SQL catalog holds `table` under, when exactly one does."""
    if not _is_sql(props):
        return None
    import sqlalchemy as sa

    namespace, _, name = table.rpartition(".")
    engine = sa.create_engine(props["uri"])
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT DISTINCT catalog_name FROM iceberg_tables WHERE table_namespace = :ns "
                                        "AND table_name = :name"), {"ns": namespace, "name": name}).fetchall()
    except Exception:
        return None
    finally:
        engine.dispose()
    return rows[0][0] if len(rows) == 1 else None


def _check_sqlite(props: dict) -> None:
    """A SQL catalog on a SQLite file that does not exist: SQLite would make an empty one."""
    uri = props.get("uri", "")
    if _is_sql(props) and uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
        path = uri[len("sqlite:///"):].split("?", 1)[0]
        if not os.path.isfile(path):
            raise ConfigError(f"pipelines.source.catalog: uri = {uri!r}: no SQLite catalog database there")


def schema_of(table, snapshot, pinned: bool) -> tuple[pa.Schema, dict[str, int]]:
    """The schema rows are read in, as Arrow, and each top-level column's field id: a pinned
    snapshot's own schema (time travel, as Spark reads it), else the table's current one."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    schema = table.schema()
    if pinned and snapshot.schema_id is not None:
        schema = table.schemas().get(snapshot.schema_id, schema)
    arrow = schema_to_pyarrow(schema, include_field_ids=False)
    return arrow, {f.name: f.field_id for f in schema.fields}


def data_files(table, snapshot, where: str) -> list[tuple[str, int]]:
    """(URL, rows) of the snapshot's data files, in the scan's plan order sorted by path."""
    tasks = list(table.scan(snapshot_id=snapshot.snapshot_id).plan_files())
    out = []
    for t in tasks:
        _check_file(t.file, where)
        if t.delete_files:
            first = next(iter(t.delete_files)).file_path
            raise DataError(
                f"{where}: snapshot {snapshot.snapshot_id} has delete files (row-level deletes, e.g. {first}); "
                "read as Parquet the deleted rows would come back. Rewrite the data files without them "
                "(Spark: CALL system.rewrite_data_files) and prepare again"
            )
        out.append((url_of(t.file.file_path), t.file.record_count))
    return sorted(out)


def _check_file(data_file, where: str) -> None:
    fmt = str(getattr(data_file.file_format, "value", data_file.file_format)).upper()
    if fmt != "PARQUET":
        raise DataError(f"{where}: data file {data_file.file_path} is {fmt}; shardline reads Parquet data files")


def url_of(path: str) -> str:
    return path if "://" in path else f"file://{path}"


def added(table, since: int, snapshot, where: str) -> list[tuple[str, int]]:
    """(URL, rows) of the data files the snapshots after `since` up to `snapshot` appended.

    Appends add data files and nothing else; a rewrite (replace: compaction) changes no
    rows and is skipped; an overwrite or a delete changes rows the dataset holds: refused."""
    chain, s = [], snapshot
    while s is not None and s.snapshot_id != since:
        chain.append(s)
        s = table.snapshot_by_id(s.parent_snapshot_id) if s.parent_snapshot_id is not None else None
    if s is None:
        raise DataError(f"{where}: snapshot {snapshot.snapshot_id} does not descend from snapshot {since}, the one "
                        "the dataset was prepared from; run `shardline prepare --append --refit` to read it whole")
    out = []
    for snap in reversed(chain):
        op = str(getattr(snap.summary.operation, "value", snap.summary.operation)) if snap.summary else "append"
        if op == "replace":
            continue
        if op != "append":
            raise DataError(
                f"{where}: snapshot {snap.snapshot_id} is an {op} (it removed or changed rows the dataset holds); "
                f"an append only adds rows: run `shardline prepare --append --refit` to read snapshot "
                f"{snapshot.snapshot_id} whole"
            )
        for mf in snap.manifests(table.io):
            if getattr(mf, "added_snapshot_id", None) != snap.snapshot_id:
                continue
            for entry in mf.fetch_manifest_entry(table.io, discard_deleted=True):
                status = str(getattr(entry.status, "name", entry.status)).upper()
                if status == "ADDED" and entry.snapshot_id == snap.snapshot_id:
                    _check_file(entry.data_file, where)
                    out.append((url_of(entry.data_file.file_path), entry.data_file.record_count))
    return out


def renames(file_schema: pa.Schema, ids: dict[str, int]) -> tuple[tuple[str, str], ...]:
    """(table column, file column) for columns the file names otherwise, found by field id."""
    by_id = {}
    for f in file_schema:
        raw = (f.metadata or {}).get(FIELD_ID)
        if raw is not None:
            by_id[int(raw)] = f.name
    return tuple((c, by_id[i]) for c, i in ids.items() if i in by_id and by_id[i] != c)


def catalog_name(src: SourceConfig) -> str:
    """How the manifest names the catalog: its name, else its uri, never its credentials."""
    from shardline.foundation.redact import redact

    return redact(str(src.catalog.get("name") or src.catalog.get("uri") or src.catalog.get("type", "")))
