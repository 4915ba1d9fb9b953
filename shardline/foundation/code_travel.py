"""Code travels with the job: shardline's own packages and the user's code, zipped on the
driver, shipped to Spark executors (classic and Connect) and Dask workers, and (the user's)
made current in the process that runs it. This module is the one place code is shipped.

Which folders travel is the caller's to say (training: the package of `training.model`
and friends plus `training.code_paths`); this module only moves them. Each folder goes
under its own name at the zip's root (`import mypkg` works), a single .py file as itself.

**No stale copy.** Spark reuses its Python workers and Dask workers live on, so a module
imported by an earlier run stays in `sys.modules` after the user changed it; and Spark
refuses a second artifact of the same name with other content. So the zip is named by a
hash of its content (`shardline-user-<sha>.zip`, foundation.zips: changed code is a new
artifact, the same code is the same one, shipped once), and `use_code`, called in the worker before the
user's code is imported, puts this job's zip first on the path and drops the modules of
the user's top-level packages that were loaded from anywhere else. What the job passes to
its workers names the user's objects by import path (strings), never pickled, so nothing
of theirs is unpickled before `use_code` has run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import os
import socket
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import shardline

from .errors import ShardlineError
from .zips import LOCK, content_zip

# Imported inside the functions that use them: foundation.spark_setup (a cycle: it imports this module); Dask
# (only with a Dask client).

PREFIX = "shardline-user-"  # shardline-user-<sha>.zip


@dataclass(frozen=True)
class UserCode:
    """One version of the user's code: what a worker needs to import it, and what the code
    is by content; small and picklable.

    A job takes it once on the driver (`snapshot`), and every rank, restart and scorer of
    the job imports exactly these bytes, whatever the folders hold by then.
    files: each shipped file's sha256, keyed by its name in the zip (`mypkg/nets.py`),
    hashed from the very bytes the zip is written from; `digest` is one hash of them all
    (the checkpoints' fingerprint keeps it, and the files, to name what changed).
    zip_name: the shipped zip (`shardline-user-<hash>.zip`), found on the worker's path or
    in its files folder; zip_path: where it is on the driver's host (the local launcher's
    ranks import it from there). No user code (a built-in model): no packages, no files,
    an empty digest.
    """

    packages: tuple[str, ...]  # the top-level import names it provides
    zip_name: str | None = None
    folders: tuple[str, ...] = ()  # the driver's paths (used in place when zip_name is None)
    zip_path: str | None = None
    files: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return code_digest(self.files)

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


def code_digest(files: dict[str, str]) -> str:
    """One digest of per-file digests ({name: sha256}); "" for no files."""
    if not files:
        return ""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def code_zip(folders: Sequence[str]) -> tuple[str, UserCode]:
    """The zip of `folders` (made once per content in this process) and its UserCode: each
    file is read once, and both its digest and the zip come from those bytes."""
    datas = [(arc, path.read_bytes(), path.stat().st_mode) for arc, path in _files(folders)]
    path = content_zip(PREFIX, datas)
    names = tuple(n for n, _ in top_names(folders))
    files = {arc: hashlib.sha256(data).hexdigest() for arc, data, _ in datas}
    return path, UserCode(names, os.path.basename(path), tuple(str(f) for f in folders), path, files)


def snapshot(folders: Sequence[str]) -> UserCode:
    """The user's code as it is now, zipped and named by its content; empty for no code."""
    return code_zip(folders)[1] if folders else UserCode(())


# ---------------------------------------------------------------- shipping (driver side)

# Engine handle (a SparkSession or a Dask client) -> names of the zips it was given. Weak: a
# session that is gone takes its entry along (an id() could be reused by the next session).
_SHIPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ship_once(handle, name: str, send) -> None:
    """send() unless `handle` has this zip already. Locked: a sweep's concurrent trials ship
    the same zip."""
    with LOCK:
        done = _SHIPPED.setdefault(handle, set())
        if name not in done:
            send()
            done.add(name)


# What tasks and ranks import: the foundation, the stages, and the engines whose task code
# (shardline.engines.<name>.prepare, score, launch) they unpickle.
ENGINE_PACKAGES = ("foundation", "pipelines", "training", "serving", "engines")


def shardline_files():
    """(name in the archive, file) for shardline's code that runs on executors: the
    `shardline` package with ENGINE_PACKAGES inside it, laid out as installed, whether this
    process runs from a checkout or an installed package."""
    top = Path(shardline.__file__).resolve().parent
    yield "shardline/__init__.py", top / "__init__.py"
    for pkg in ENGINE_PACKAGES:
        folder = Path(importlib.import_module(f"shardline.{pkg}").__file__).resolve().parent
        for f in sorted(folder.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
                yield f"shardline/{pkg}/{f.relative_to(folder).as_posix()}", f


def shardline_zip() -> str:
    """shardline's engine packages as one zip (foundation.zips: named by content)."""
    global _SHARDLINE_ZIP
    with LOCK:
        if _SHARDLINE_ZIP is None:
            _SHARDLINE_ZIP = content_zip("shardline-code-", shardline_files())
    return _SHARDLINE_ZIP


_SHARDLINE_ZIP: str | None = None


def ship_shardline_to_spark(spark) -> None:
    """shardline's ENGINE_PACKAGES for executors that do not run on this machine's
    Python path: every Connect server (its executors are the server's), classic non-local
    masters. Without them a barrier stage aborts on ModuleNotFoundError.

    `addArtifacts(..., pyfile=True)` is the one call for both (on classic Spark 4 it is
    `addPyFile`); Spark puts the zip ahead of installed packages on the executors, so they
    run this driver's code."""
    from .spark_setup import is_connect, spark_master

    if is_connect(spark) or not spark_master(spark).startswith("local"):
        path = shardline_zip()
        _ship_once(spark, os.path.basename(path), lambda: _add_artifact(spark, path))


def ship_shardline_to_dask(client) -> None:
    """Workers started elsewhere import our packages from this zip, also those that join
    later; a LocalCluster's workers in this process's machine run its environment already.

    To the workers only (`client.upload_file` sends it to the scheduler too, which runs no
    task): a scheduler in the driver's own process (a notebook's LocalCluster given by its
    address) would put the zip first on the driver's path and re-import shardline from it."""
    if getattr(client, "cluster", None) is not None:
        return
    from distributed.diagnostics.plugin import UploadFile

    path = shardline_zip()
    name = os.path.basename(path)  # shardline-code-<digest>.zip
    _ship_once(client, name, lambda: client.register_plugin(UploadFile(path), name=name))


def ship_to_spark(spark, code: UserCode | None) -> UserCode | None:
    """Add the user's zip to a SparkSession (classic, any master, or Connect) as a Python
    artifact: every later task of the session has it on its path. Shipped on local
    masters too: their Python workers are reused from run to run like an executor's."""
    if code is None or code.zip_path is None:  # no user code, or folders used in place
        return code
    _ship_once(spark, code.zip_name, lambda: _add_artifact(spark, code.zip_path))
    return code


def _add_artifact(spark, path: str) -> None:
    before = list(sys.path)
    spark.addArtifacts(path, pyfile=True)
    # Classic Spark's addPyFile also puts the zip on this driver's path ("for tests in local
    # mode"): the driver imports shardline and the user's code from where they are.
    sys.path[:] = before


def ship_to_dask(client, code: UserCode | None) -> UserCode | None:
    """Upload the user's zip to every Dask worker, also those that join later.

    To the workers only, and not imported on arrival (load=False): a scheduler in the
    driver's own process must not put it on the driver's path, and the user's modules
    are imported by the task that needs them, after `use_code`.
    """
    if code is None or code.zip_path is None:
        return code
    from distributed.diagnostics.plugin import UploadFile

    _ship_once(client, code.zip_name,
               lambda: client.register_plugin(UploadFile(code.zip_path, load=False), name=code.zip_name))
    return code


# ---------------------------------------------------------------- in the worker


def use_code(code: UserCode | None) -> None:
    """Make `code` the user's code this process imports: its zip (or, on the driver's host,
    its folders' parents) first on sys.path, and every module of its top-level packages
    that was loaded from elsewhere (an older zip, another folder) dropped from sys.modules,
    so the next import reads this version. Modules already from here are kept."""
    if code is None or not code.packages:
        return
    if code.zip_name:
        here = code.zip_path if code.zip_path and os.path.isfile(code.zip_path) else None
        roots = [here or _find_zip(code.zip_name)]
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


def locate(code: UserCode | None) -> UserCode | None:
    """`code` with its `zip_path` where the zip is on this host, found by this process (a Dask
    worker knows its files folder): for a process it starts that is no worker itself (a
    rank's, shardline.engines.dask.launch). Refused as `use_code` would refuse it."""
    if code is None or not code.zip_name or (code.zip_path and os.path.isfile(code.zip_path)):
        return code
    return dataclasses.replace(code, zip_path=_find_zip(code.zip_name))


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
