"""The user's own code: objects named by import path, and the folders that hold them.

`training.model`, `training.loop`, `training.loss` and `training.metrics` may name the user's callables as
'package.module:callable'. They are imported on the driver first (a bad path is one line
before any engine starts), and the folders holding them travel with the job: to local
ranks, Spark executors, Dask workers, and into the registered model.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import sysconfig
from pathlib import Path

from shardline.foundation.code_travel import UserCode, top_names, use_code
import shardline
from shardline.foundation.errors import ConfigError, ShardlineError


def is_import_path(name: str) -> bool:
    return ":" in name


def cwd_on_path() -> None:
    """The folder the command runs from is importable, as with `python -m` (a console
    script's sys.path[0] is its bin folder, not the user's project)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def import_object(path: str, setting: str):
    """The object `path` ('package.module:attr.attr') names; one ConfigError line if not."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{setting}: {path!r} is not an import path 'package.module:callable'")
    cwd_on_path()
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any error in the user's module is theirs to see
        shadowed = _own_shardline_folder(module_name) if isinstance(e, ModuleNotFoundError) else None
        if shadowed is not None:
            raise ConfigError(
                f"{setting}: cannot import module {module_name!r}: the name 'shardline' is taken by shardline "
                f"itself, so your folder {shadowed} is never imported by it; rename that folder and "
                f"{setting} with it") from None
        raise ConfigError(f"{setting}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{setting}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def _own_shardline_folder(module_name: str) -> Path | None:
    """A folder of the user's named `shardline` holding `module_name`'s next part, on the
    import path: `shardline.mynets` then finds shardline's own package, which has no `mynets`."""
    parts = module_name.split(".")
    if parts[0] != "shardline" or len(parts) < 2:
        return None

    ours = Path(shardline.__file__).resolve().parent
    for entry in dict.fromkeys([os.getcwd(), *sys.path]):
        folder = Path(entry or os.getcwd()).resolve() / "shardline"
        if folder.resolve() != ours and ((folder / f"{parts[1]}.py").is_file() or (folder / parts[1]).is_dir()):
            return folder
    return None


def _model_code_folder(entry: str) -> bool:
    """An MLflow model's `code` folder (beside its MLmodel file) on sys.path."""
    folder = Path(entry or os.getcwd())
    return folder.name == "code" and (folder.parent / "MLmodel").is_file()


def _installed_roots() -> set[Path]:
    paths = sysconfig.get_paths()
    return {Path(paths[k]).resolve() for k in ("purelib", "platlib", "stdlib", "platstdlib") if k in paths}


def package_location(path: str) -> Path | None:
    """The folder (or single .py file) of the top-level package `path` imports from, when
    it is the user's own code: None for shardline itself and for installed packages."""
    top = path.partition(":")[0].split(".")[0]
    if top == "shardline":
        return None
    cwd_on_path()
    # Searched on sys.path, not taken from sys.modules: a package imported earlier in this
    # process may come from somewhere else (a registered model's code folder, since removed).
    # Nor from a loaded model's code folder, which mlflow.pyfunc.load_model puts first on
    # sys.path: that is the code as it was logged, not the user's project as it is now
    # (unless the package is nowhere else).
    own = [e for e in sys.path if not _model_code_folder(e)]
    spec = importlib.machinery.PathFinder.find_spec(top, own) or importlib.machinery.PathFinder.find_spec(top, sys.path)
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    where = origin.parent if origin.name == "__init__.py" else origin
    roots = _installed_roots()
    if any(root == where or root in where.parents for root in roots):
        return None
    return where


def user_code_folders(import_paths: list[str], code_paths: list[str]) -> list[str]:
    """Absolute folders/files of the user's code: each import path's own package (unless
    installed) and every `training.code_paths` entry, resolved on the driver."""
    out: list[str] = []
    for p in import_paths:
        if p and is_import_path(p):
            where = package_location(p)
            if where is not None and str(where) not in out:
                out.append(str(where))
    for c in code_paths:
        where = Path(c).expanduser().resolve()
        if not where.exists():
            raise ConfigError(f"training.code_paths: {c!r} does not exist (resolved to {where})")
        if str(where) not in out:
            out.append(str(where))
    return out


def code_paths_on_path(code_paths: list[str]) -> None:
    """Each `training.code_paths` entry importable as MLflow's code_paths are: its parent
    folder on sys.path (a folder `src/mypkg` is the package `mypkg`). Relative entries are
    the command's folder's (a local rank runs in it too); an entry that is not here is left
    to whoever ships it (Spark executors, Dask workers)."""
    for c in code_paths:
        where = Path(c).expanduser().resolve()
        if where.exists() and str(where.parent) not in sys.path:
            sys.path.insert(0, str(where.parent))


def import_user_object(path: str, setting: str, code_paths: list[str]):
    """import_object, with the cwd and `training.code_paths` on sys.path first."""
    code_paths_on_path(code_paths)
    return import_object(path, setting)


def job_code_folders(cfg) -> list[str]:
    """The folders (and .py files) of the user's code a training job ships to its ranks:
    the packages of `training.model`, `training.loop`, `training.loss` and `training.metrics`
    (when they are the user's own) and every `training.code_paths` entry. Two of one name are
    refused: both would be imported as that name."""
    folders = user_code_folders([cfg.model, cfg.loop or "", cfg.loss or "", *cfg.metrics], cfg.code_paths)
    try:
        top_names(folders)
    except ShardlineError as e:
        raise ConfigError(f"training.code_paths: {e}") from None
    return folders


# Top-level package -> the digest of the code snapshot (foundation.code_travel.UserCode) this
# driver process last imported it for.
_IMPORTED_FOR: dict[str, str] = {}


def refresh_driver_code(code) -> None:
    """Make this process import the user's code as `code` (the job's snapshot) holds it.

    A notebook trains, the user edits the model's file, and trains again in the same Python:
    the modules imported for the first job are still in sys.modules, and `import_module`
    would hand the driver the old code while every rank runs the new (its zip is named by
    its content). So when the snapshot's digest differs from the one the package was last
    imported for here, every module of the user's top-level packages is dropped, and the
    next import reads the files again. The same digest keeps what is loaded (a sweep's
    trials, a job's restarts). A package imported before any job (a notebook's own import)
    is dropped once too: which version it is cannot be told.

    And whatever sys.path holds, the job's folders come first and a module of theirs loaded
    from anywhere else is dropped (foundation.code_travel.use_code): after
    `mlflow.pyfunc.load_model` the model's own copy of the package (its code folder, which
    MLflow puts first on sys.path) would otherwise be what the driver imports and checks.
    """
    if code is None or not code.packages:
        return
    use_code(UserCode(code.packages, None, code.folders))
    stale = [p for p in code.packages if _IMPORTED_FOR.get(p) != code.digest]
    if not stale:
        return
    for name in list(sys.modules):
        if name.split(".", 1)[0] in stale:
            sys.modules.pop(name, None)
    importlib.invalidate_caches()
    for p in stale:
        _IMPORTED_FOR[p] = code.digest


def check_driver_imports(code) -> None:
    """The user's packages this process imported for the job are the job's code (`code`,
    its snapshot's folders): refused in one line if one came from elsewhere (a finder of
    its own ahead of sys.path, a module put in sys.modules by hand), which the ranks,
    importing the snapshot, would not run."""
    if code is None or not code.packages:
        return
    roots = tuple(os.path.join(str(Path(f).parent), "") for f in code.folders)
    for name in code.packages:
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or []), None)
        if module is not None and where and not os.path.realpath(where).startswith(
                tuple(os.path.realpath(r) + os.sep for r in roots)):
            raise ConfigError(
                f"training.model: the package {name!r} was imported from {where}, not from the job's code "
                f"({', '.join(code.folders)}), which every rank runs; take it off the import path or "
                "restart Python"
            )
