"""A Delta Lake table as prepare's input, through delta-rs (`deltalake`), on the driver only.

`snapshot` pins one version (the latest, `version` or `timestamp`) and lists its live
data files with their partition values; `added` lists the rows the versions after an
earlier one added, from the log's commits: the files an append added, or the inserted
rows of the change data (`delta.enableChangeDataFeed`) where a commit rewrote files.
A table feature a plain Parquet read of those files cannot honour is refused by name.
"""

from __future__ import annotations

import json
import os
from urllib.parse import unquote

import pyarrow as pa

from shardline.foundation import storage
from shardline.foundation.errors import ConfigError, DataError, first_line
from .source_config import SourceConfig
from .table_files import CHANGE_TYPE

# Reader features that change nothing for a read of the live files' Parquet (the log is
# delta-rs's business; type widening is a cast to the table's type, done in every task).
# columnMapping and deletionVectors are allowed while no column is mapped and no live file
# has a deletion vector: both are checked on the version read.
_HONOURED = {"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "typeWidening", "typeWidening-preview",
             "columnMapping", "deletionVectors"}


def storage_options(url: str) -> dict[str, str] | None:
    """delta-rs's options for an s3:// table, from the standard AWS chain shardline's own
    storage uses (AWS_ENDPOINT_URL, credentials, region); None elsewhere (local: none needed,
    other stores: delta-rs reads their standard environment variables itself)."""
    if storage.scheme(url) != "s3":
        return None
    from shardline.foundation.object_stores import _custom_endpoint, s3_client

    client = s3_client()
    opts = {"AWS_REGION": client.meta.region_name or "us-east-1"}
    creds = client._get_credentials() if hasattr(client, "_get_credentials") else None
    if creds is None:
        import boto3

        creds = boto3.session.Session().get_credentials()
    if creds is not None:
        frozen = creds.get_frozen_credentials()
        opts.update(AWS_ACCESS_KEY_ID=frozen.access_key, AWS_SECRET_ACCESS_KEY=frozen.secret_key)
        if frozen.token:
            opts["AWS_SESSION_TOKEN"] = frozen.token
    endpoint = _custom_endpoint()
    if endpoint:
        opts["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.startswith("http://"):
            opts["AWS_ALLOW_HTTP"] = "true"
    # S3 has no atomic rename; a writer needs a lock or conditional writes. shardline writes a
    # Delta table only under its output's lease (one job at a time), and says so in the docs.
    opts.setdefault("AWS_S3_ALLOW_UNSAFE_RENAME", os.environ.get("AWS_S3_ALLOW_UNSAFE_RENAME", "true"))
    return opts


def native(url: str) -> str:
    """The URL as delta-rs takes it: local tables by their plain path."""
    return storage.local_path(url) if not storage.is_remote(url) else url


def is_table(url: str) -> bool:
    return storage.is_dir(storage.join(url, "_delta_log")) or storage.is_file(
        storage.join(url, "_delta_log", f"{0:020d}.json"))


def open_table(src: SourceConfig, where: str):
    """The DeltaTable at the version `src` pins (version, timestamp, else the latest)."""
    from deltalake import DeltaTable

    root = src.path
    if not is_table(root):
        raise ConfigError(f"{where}: not a Delta table (no _delta_log folder in it)")
    opts = storage_options(root)
    try:
        table = DeltaTable(native(root), storage_options=opts)
    except Exception as e:
        raise ConfigError(f"{where}: cannot open the Delta table ({first_line(e)})") from None
    latest = table.version()
    if src.version is not None and src.version != latest:
        try:
            table.load_as_version(src.version)
        except Exception:
            raise ConfigError(
                f"{where}: pipelines.source.version = {src.version}: no such version "
                f"(the table's latest is {latest}, and versions older than its log retention are gone)"
            ) from None
    elif src.timestamp is not None:
        when = src.pinned_time()
        try:
            table.load_as_version(when)
            committed = _commit_time(root, table.version())
        except Exception as e:
            committed, error = None, first_line(e)
        else:
            error = None
        if error is not None or (committed is not None and committed > when):
            why = error or f"its oldest version, {table.version()}, was committed at {committed.isoformat()}"
            raise ConfigError(f"{where}: pipelines.source.timestamp = {src.timestamp!r}: no version of the table "
                              f"was current then ({why})") from None
    return table


def _commit_time(root: str, version: int):
    """When `version` was committed (its commitInfo), or None when its log file is gone."""
    import datetime as dt

    url = storage.join(root if "://" in root else f"file://{root}", "_delta_log", f"{version:020d}.json")
    try:
        lines = storage.read_bytes(url).decode().splitlines()
    except FileNotFoundError:
        return None
    for ln in lines:
        info = json.loads(ln).get("commitInfo") if ln.strip() else None
        if info and "timestamp" in info:
            ms = info.get("inCommitTimestamp", info["timestamp"])
            return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)
    return None


def check_features(table, where: str) -> None:
    """Refuse what a read of the live files' Parquet would get wrong, naming the feature."""
    proto = table.protocol()
    config = table.metadata().configuration or {}
    mode = config.get("delta.columnMapping.mode", "none")
    if mode and mode != "none":
        raise DataError(
            f"{where}: the table uses column mapping (delta.columnMapping.mode = {mode!r}): its files "
            "name columns by physical ids, which shardline does not read; rewrite the table without it"
        )
    unknown = sorted(set(proto.reader_features or []) - _HONOURED)
    if unknown:
        raise DataError(f"{where}: the table needs reader feature(s) {', '.join(unknown)}, which shardline "
                        "cannot honour when it reads the data files")
    if proto.min_reader_version > 3:
        raise DataError(f"{where}: Delta reader version {proto.min_reader_version} is newer than shardline reads (3)")
    if "deletionVectors" in (proto.reader_features or []):
        marked = pa.table(table.deletion_vectors())
        if marked.num_rows:
            first = marked.column("filepath")[0].as_py()
            raise DataError(
                f"{where}: the table uses deletion vectors ({marked.num_rows} data file(s) have deleted rows "
                f"marked beside them, e.g. {first}); read as Parquet those rows would come back. Rewrite "
                "the files without them (Spark: REORG TABLE ... APPLY (PURGE)) and prepare again"
            )


def schema_of(table) -> pa.Schema:
    return pa.schema(table.schema().to_arrow())


def live_files(table, root: str) -> list[tuple[str, dict, int]]:
    """(URL, partition values, rows) of the version's live data files, oldest first."""
    adds = pa.table(table.get_add_actions(flatten=False))
    parts = adds.column("partition").to_pylist() if "partition" in adds.column_names else [{}] * adds.num_rows
    rows = adds.column("num_records").to_pylist() if "num_records" in adds.column_names else [None] * adds.num_rows
    found = [
        (int(t.timestamp() * 1000) if hasattr(t, "timestamp") else int(t or 0), path, p or {}, n)
        for t, path, p, n in zip(adds.column("modification_time").to_pylist(), adds.column("path").to_pylist(),
                                 parts, rows)
    ]
    return [(file_url(root, path), p, n) for _, path, p, n in sorted(found, key=lambda f: (f[0], f[1]))]


def file_url(root: str, path: str) -> str:
    """A data file's URL: the log's paths are relative to the root (and URL-encoded) or absolute."""
    if "://" in path:
        return path
    base = root if "://" in root else f"file://{root}"
    return storage.join(base, unquote(path))


# -- what later versions added (prepare --append) ---------------------------------------------


def added(root: str, since: int, upto: int, schema: pa.Schema, where: str) -> list[tuple[str, dict, str | None]]:
    """(URL, partition values, change type to keep) of the rows versions since+1..upto added.

    From each commit's own actions: a commit that only adds files (an append) added their
    rows; one that removes or rewrites rows (DELETE, UPDATE, MERGE, an overwrite) is read
    from its change data when the table records it (delta.enableChangeDataFeed), keeping the
    inserted rows, and refused when its change data says rows were deleted or updated (an
    append cannot take rows back out of the dataset) or when there is none to read.
    Compaction (dataChange = false) changes no rows and is skipped.
    """
    out: list[tuple[str, dict, str | None]] = []
    for v in range(since + 1, upto + 1):
        url = storage.join(root if "://" in root else f"file://{root}", "_delta_log", f"{v:020d}.json")
        try:
            lines = storage.read_bytes(url).decode().splitlines()
        except FileNotFoundError:
            raise DataError(
                f"{where}: the log of version {v} is gone (older than the table's log retention), so what it "
                f"added cannot be told; run `shardline prepare --append --refit` to read version {upto} whole"
            ) from None
        actions = [json.loads(ln) for ln in lines if ln.strip()]
        adds = [a["add"] for a in actions if "add" in a and a["add"].get("dataChange", True)]
        removes = [a["remove"] for a in actions if "remove" in a and a["remove"].get("dataChange", True)]
        cdc = [a["cdc"] for a in actions if "cdc" in a]
        if cdc:
            for c in cdc:
                f = file_url(root, c["path"])
                kinds = _change_types(f)
                if kinds - {"insert"}:
                    raise DataError(
                        f"{where}: version {v} {' and '.join(sorted(_WORDS[k] for k in kinds - {'insert'}))} "
                        f"rows the dataset holds (the table's change data says so); an append only adds rows: "
                        f"run `shardline prepare --append --refit` to read version {upto} whole"
                    )
                out.append((f, _typed(c.get("partitionValues") or {}, schema), "insert"))
        elif removes:
            raise DataError(
                f"{where}: version {v} removed or rewrote rows (DELETE, UPDATE, MERGE or an overwrite) and the "
                "table records no change data, so the rows it added cannot be told apart: set "
                "delta.enableChangeDataFeed = true on the table for later versions, or run "
                f"`shardline prepare --append --refit` to read version {upto} whole"
            )
        else:
            for a in adds:
                if a.get("deletionVector"):
                    raise DataError(f"{where}: version {v} added a file with a deletion vector ({a['path']})")
                out.append((file_url(root, a["path"]), _typed(a.get("partitionValues") or {}, schema), None))
    return out


_WORDS = {"delete": "deleted", "update_preimage": "updated", "update_postimage": "updated"}


def _change_types(url: str) -> set[str]:
    import pyarrow.parquet as pq

    with storage.open_input(url) as f:
        col = pq.read_table(f, columns=[CHANGE_TYPE]).column(CHANGE_TYPE)
    return {v for v in col.to_pylist() if v is not None}


def _typed(values: dict[str, str | None], schema: pa.Schema) -> dict:
    """The log's partition values (text) as the columns' types."""
    out = {}
    for c, v in values.items():
        kind = schema.field(c).type if c in schema.names else pa.string()
        out[c] = None if v is None else pa.array([v], pa.string()).cast(kind)[0].as_py()
    return out
