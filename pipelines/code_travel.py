"""The user's own code travels with the job: zipped on the driver, shipped to Spark
executors (classic and Connect) and Dask workers, and made current in the process that
runs it.

Which folders travel is the caller's to say (training: the package of `training.model`
and friends plus `training.code_paths`); this module only moves them. Each folder goes
under its own name at the zip's root (`import mypkg` works), a single .py file as itself.

**No stale copy.** Spark reuses its Python workers and Dask workers live on, so a module
imported by an earlier run stays in `sys.modules` after the user changed it; and Spark
refuses a second artifact of the same name with other content. So the zip is named by a
hash of its content (`shardline-user-<sha>.zip`, pipelines.zips: changed code is a new
artifact, the same code is the same one, shipped once), and `use_code`, called in the worker before the
user's code is imported, puts this job's zip first on the path and drops the modules of
the user's top-level packages that were loaded from anywhere else. What the job passes to
its workers names the user's objects by import path (strings), never pickled, so nothing
of theirs is unpickled before `use_code` has run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ShardlineError
from .zips import LOCK, content_zip

PREFIX = "shardline-user-"  # shardline-user-<sha>.zip


@dataclass(frozen=True)
class UserCode:
    """What a worker needs to import the user's code; small and picklable.

    zip_name: the shipped zip (found on the worker's path or in its files folder);
    None for processes of the driver's own host, which import from `folders` in place.
    """

    packages: tuple[str, ...]  # the top-level import names it provides
    zip_name: str | None = None
    folders: tuple[str, ...] = ()  # the driver's paths (used in place when zip_name is None)


def top_names(folders: Sequence[str]) -> list[tuple[str, Path]]:
    """(import name, path) of each folder or .py file; refuses what cannot be imported."""
    out: dict[str, Path] = {}
    for f in folders:
        p = Path(f)
        if p.is_file() and p.suffix != ".py":
            raise ShardlineError(f"{f}: user code must be a folder or a .py file")
        name = p.stem if p.is_file() else p.name
        if name == "shardline":
            raise ShardlineError(f"{f}: would be imported as 'shardline', in place of shardline itself")
        if name in out and out[name] != p:
            raise ShardlineError(f"{out[name]} and {p}: both would be imported as {name!r}")
        out[name] = p
    return list(out.items())


def local_code(folders: Sequence[str]) -> UserCode | None:
    """For processes on the driver's host (the local launcher's ranks): no zip, the folders."""
    if not folders:
        return None
    return UserCode(tuple(n for n, _ in top_names(folders)), None, tuple(str(f) for f in folders))


def _files(folders: Sequence[str]) -> list[tuple[str, Path]]:
    """(name in the zip, file), sorted: each folder under its own name, caches left out."""
    out = []
    for name, p in top_names(folders):
        if p.is_file():
            out.append((f"{name}.py", p))
            continue
        for f in p.rglob("*"):
            rel = f.relative_to(p)
            hidden = any(part.startswith(".") or part == "__pycache__" for part in rel.parts)
            if f.is_file() and not hidden and f.suffix not in (".pyc", ".pyo"):
                out.append((f"{name}/{rel.as_posix()}", f))
    return sorted(out)


@dataclass(frozen=True)
class CodeSnapshot:
    """What the user's code is, by content: each shipped file's sha256 keyed by its name in
    the zip (`mypkg/nets.py`), and one digest of them all. Made from the files the zip is
    made from, so what is hashed is exactly what ships. No user code (a built-in model):
    no files and an empty digest."""

    files: dict[str, str]
    digest: str

    def changes(self, earlier: dict[str, str]) -> list[str]:
        """How this code differs from `earlier` files ({name: sha256}), one phrase a file,
        sorted by name: `mypkg/nets.py changed`, `... added`, `... removed`."""
        out = []
        for name in sorted(earlier.keys() | self.files.keys()):
            if name not in earlier:
                out.append(f"{name} added")
            elif name not in self.files:
                out.append(f"{name} removed")
            elif earlier[name] != self.files[name]:
                out.append(f"{name} changed")
        return out


def code_digest(files: dict[str, str]) -> str:
    """One digest of per-file digests ({name: sha256}); "" for no files."""
    if not files:
        return ""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def snapshot(folders: Sequence[str]) -> CodeSnapshot:
    """The CodeSnapshot of `folders` (the zip's file list, `_files`); empty for none."""
    files = {arc: hashlib.sha256(path.read_bytes()).hexdigest() for arc, path in _files(folders)}
    return CodeSnapshot(files, code_digest(files))


def code_zip(folders: Sequence[str]) -> tuple[str, UserCode]:
    """The zip of `folders` (made once per content in this process) and its UserCode."""
    path = content_zip(PREFIX, _files(folders))
    return path, UserCode(tuple(n for n, _ in top_names(folders)), os.path.basename(path), tuple(str(f) for f in folders))


# ---------------------------------------------------------------- shipping (driver side)

_SHIPPED: set[tuple[int, str]] = set()


def ship_to_spark(spark, folders: Sequence[str]) -> UserCode | None:
    """Add the user's zip to a SparkSession (classic, any master, or Connect) as a Python
    artifact: every later task of the session has it on its path. Shipped on local
    masters too: their Python workers are reused from run to run like an executor's."""
    if not folders:
        return None
    path, code = code_zip(folders)
    key = (id(spark), code.zip_name)
    with LOCK:  # a sweep's concurrent trials ship the same zip
        if key in _SHIPPED:
            return code
        before = list(sys.path)
        spark.addArtifacts(path, pyfile=True)
        # Classic Spark's addPyFile also puts the zip on this driver's path ("for tests in
        # local mode"): the driver imports the user's code from the folders themselves.
        sys.path[:] = before
        _SHIPPED.add(key)
    return code


def ship_to_dask(client, folders: Sequence[str]) -> UserCode | None:
    """Upload the user's zip to every Dask worker, also those that join later.

    To the workers only, and not imported on arrival (load=False): a scheduler in the
    driver's own process must not put it on the driver's path, and the user's modules
    are imported by the task that needs them, after `use_code`.
    """
    if not folders:
        return None
    from distributed.diagnostics.plugin import UploadFile

    path, code = code_zip(folders)
    key = (id(client), code.zip_name)
    with LOCK:
        if key not in _SHIPPED:
            client.register_plugin(UploadFile(path, load=False), name=code.zip_name)
            _SHIPPED.add(key)
    return code


# ---------------------------------------------------------------- in the worker


def use_code(code: UserCode | None) -> None:
    """Make `code` the user's code this process imports: its zip (or, on the driver's host,
    its folders' parents) first on sys.path, and every module of its top-level packages
    that was loaded from elsewhere (an older zip, another folder) dropped from sys.modules,
    so the next import reads this version. Modules already from here are kept."""
    if code is None:
        return
    if code.zip_name:
        roots = [_find_zip(code.zip_name)]
    else:
        roots = list(dict.fromkeys(str(Path(f).parent) for f in code.folders))
    with LOCK:
        for root in reversed(roots):
            while root in sys.path:
                sys.path.remove(root)
            sys.path.insert(0, root)
        mine = tuple(os.path.join(r, "") for r in roots)
        for name in list(sys.modules):
            if name.split(".", 1)[0] in code.packages and not _loaded_from(sys.modules.get(name), mine):
                sys.modules.pop(name, None)
        importlib.invalidate_caches()


def _loaded_from(module, prefixes: tuple[str, ...]) -> bool:
    if module is None:
        return False
    places = [getattr(module, "__file__", None), *list(getattr(module, "__path__", None) or [])]
    places = [p for p in places if p]
    return bool(places) and all(p.startswith(prefixes) for p in places)


def _find_zip(name: str) -> str:
    """Where the shipped zip is in this worker: on its path (Spark adds a task's Python
    artifacts there), else in the Dask worker's or Spark's files folder."""
    for p in sys.path:
        if os.path.basename(p) == name and os.path.isfile(p):
            return p
    folders = []
    if "distributed" in sys.modules:
        with contextlib.suppress(Exception):  # ValueError: not in a Dask worker
            from distributed import get_worker

            folders.append(get_worker().local_directory)
    if "pyspark" in sys.modules:
        with contextlib.suppress(Exception):
            from pyspark import SparkFiles

            folders.append(SparkFiles.getRootDirectory())
    for folder in folders:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    raise ShardlineError(
        f"the user's code ({name}) did not reach this worker on {socket.gethostname()}: "
        f"it is not on its Python path{' nor in ' + ', '.join(folders) if folders else ''}"
    )
