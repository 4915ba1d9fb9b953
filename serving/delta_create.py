"""A score table's first commit (Delta version 0), published whole or not at all.

delta-rs creates a table by making `_delta_log/` and then writing its first commit file
into it. A writer stopped between the two (killed, a full disk) leaves a `_delta_log/`
with no commit in it, and every Delta reader then fails on the folder ("No files in log
segment") until something writes version 0. So shardline writes version 0 itself, in
the protocol's JSON (protocol, metaData, the run's txn and its add actions: what delta-rs
writes for `create_table_with_add_actions`), and publishes it in one step: on a local
disk a complete `_delta_log/` folder, written beside the table under a temporary name,
is renamed into place (a rename replaces at most an empty folder); on an object store,
where a folder is only a prefix, the one commit object is written create-only. Before
that step the table's folder has no `_delta_log/`, and readers say "not a table".

Every later commit goes through delta-rs (serving.delta_output).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
import uuid
from urllib.parse import quote

import pyarrow as pa

from shardline.foundation import commit, storage

LOG = "_delta_log"
FIRST = f"{0:020d}.json"
_COMMIT = re.compile(r"\d{20}\.(json|checkpoint\.parquet|checkpoint\.\d+\.\d+\.parquet)")


def has_commits(root: str) -> bool:
    """Whether the table's log holds a commit: a `_delta_log/` without one (left by a
    writer stopped mid-create) is no table yet."""
    return any(_COMMIT.fullmatch(n) for n in storage.list_dir(storage.join(root, LOG)))


def is_staging(name: str) -> bool:
    """A name in the table's folder that is a first commit being written (or left by a
    writer that died writing it): ours, ignored and removed."""
    return storage.is_temp_of(name, LOG)


def log_path(rel: str) -> str:
    """A data file's path as the log names it: a relative URI, so a `%` in a percent-encoded
    model name is `%25` (what delta-rs writes)."""
    return quote(rel, safe="/=")


def first_commit(schema: pa.Schema, adds: list[dict], app: str, version: int, what: str) -> bytes:
    """Version 0's bytes. adds: {"path" (relative to the root, not encoded), "size", "rows"}."""
    from deltalake import Schema

    now = int(time.time() * 1000)
    actions = [
        {"commitInfo": {"timestamp": now, "operation": "CREATE TABLE",
                        "operationParameters": {"mode": "ErrorIfExists"}, "engineInfo": "shardline",
                        "shardline": f"score {what}"}},
        {"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}},
        {"metaData": {"id": str(uuid.uuid4()), "format": {"provider": "parquet", "options": {}},
                      "schemaString": Schema.from_arrow(schema).to_json(), "partitionColumns": [],
                      "createdTime": now, "configuration": {}}},
        {"txn": {"appId": app, "version": version, "lastUpdated": now}},
        *({"add": {"path": log_path(a["path"]), "partitionValues": {}, "size": a["size"], "modificationTime": now,
                   "dataChange": True, "stats": json.dumps({"numRecords": a["rows"]})}} for a in adds),
    ]
    return "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions).encode()


def publish_first(root: str, data: bytes) -> bool:
    """Publish version 0 in one step. False: a version 0 is there already (another writer's,
    or ours whose answer was lost); the caller reads the table to tell which."""
    clear_dead_log(root)
    if storage.is_remote(root):
        return commit.create_only(storage.join(root, LOG, FIRST), data) is not None
    folder = storage.local_path(root)
    os.makedirs(folder, exist_ok=True)
    stage = os.path.join(folder, storage.temp_name(LOG))
    try:
        os.mkdir(stage)
        with open(os.path.join(stage, FIRST), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        storage.fsync_dir(stage)
        try:
            os.rename(stage, os.path.join(folder, LOG))  # replaces an empty folder, never a log
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # gone already after a rename
    storage.fsync_dir(folder)
    return True


def clear_dead_log(root: str) -> None:
    """Remove what writers stopped mid-create left: staging folders (ours) and a
    `_delta_log/` holding no commit (delta-rs's). The caller holds the output's lease, so no
    live writer is creating the table now."""
    log = storage.join(root, LOG)
    if storage.is_dir(log) and not has_commits(root):
        storage.delete_tree(log)
    if not storage.is_remote(root):
        for name in storage.list_dir(root):
            if is_staging(name):
                with contextlib.suppress(OSError):
                    shutil.rmtree(os.path.join(storage.local_path(root), name))
