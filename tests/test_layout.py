"""The package's shape (#45 items 1 and 7): every module imports, the library never imports
the CLI's package, and `shardline` finds its subpackages as plain folders (symbolic links to
the top-level ones), with nothing done at import to extend or move them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from .conftest import REPO

LIBRARY = ("shardline", "pipelines", "training", "serving")

# Every module, each imported by name in a process of its own: a module only a CLI command
# or a benchmark reaches (e.g. `shardline bench train --images`) is imported by no other test.
_IMPORT_ALL = """
import importlib, pkgutil, shardline
bad = []
for m in pkgutil.walk_packages(shardline.__path__, "shardline."):
    try:
        importlib.import_module(m.name)
    except BaseException as e:
        bad.append(f"{m.name}: {type(e).__name__}: {e}")
print("\\n".join(bad))
"""


def test_every_module_imports():
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", out.stdout


def _imports(path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            # A relative import from inside shardline/ (level 1) names a sibling package.
            names.append(("shardline." if node.level == 1 and path.parent.name == "shardline" else "")
                         + (node.module or ""))
    return names


def test_the_library_does_not_import_the_cli():
    found = []
    for pkg in LIBRARY:
        files = (REPO / pkg).glob("*.py") if pkg == "shardline" else (REPO / pkg).rglob("*.py")
        for f in sorted(files):
            found += [f"{f.relative_to(REPO)}: {n}" for n in _imports(f)
                      if n.split(".")[:1] == ["jobs"] or n.split(".")[:2] == ["shardline", "jobs"]]
    assert not found, "\n".join(found)


def test_subpackages_are_folders_found_without_import_tricks():
    init = (REPO / "shardline" / "__init__.py").read_text()
    assert "__path__" not in init and "chdir" not in init
    for pkg in ("pipelines", "training", "serving", "jobs", "benchmarks"):
        link = REPO / "shardline" / pkg
        assert link.is_symlink() and link.resolve() == (REPO / pkg).resolve(), pkg
    import shardline.training.job as job

    assert job.__file__ == str(REPO / "shardline" / "training" / "job.py")


STAGES = ("pipelines", "training", "serving")


def test_the_stages_do_not_import_the_engines():
    """The engine is an object the API passes down (#54 item 1): a stage calls its methods and
    never imports shardline.engines (dependencies point one way)."""
    found = []
    for pkg in STAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            found += [f"{f.relative_to(REPO)}: {n}" for n in _imports(f) if n.split(".")[:2] == ["shardline", "engines"]]
    assert not found, "\n".join(found)


# A test of an engine's name: `== "spark"`, `!= 'dask'`, `in ("spark", "dask")`, `launcher == ...`.
_NAME_TEST = re.compile(r"""(==|!=)\s*['"](spark|dask|local)['"]|\bin\s*[(\[{]\s*['"](spark|dask|local)['"]"""
                        r"""|\b(launcher|engine|engine_name)\s*(==|!=)""")


# Each of these is one engine's by name: the Spark and the Dask estimator, and the Dask
# estimator's frames (which tell a Dask collection by its module's name).
_ONE_ENGINES = ("shardline/spark.py", "shardline/dask.py", "shardline/dask_frames.py")


def test_no_branch_on_an_engines_name_outside_the_engines():
    """Only shardline/engines/ knows which engine is which: everywhere else an engine is the
    object the API chose by its name (the registry), asked for what a stage needs."""
    roots = [REPO / d for d in (*STAGES, "jobs")] + [REPO / "shardline"]
    found = []
    for root in roots:
        files = root.glob("*.py") if root.name == "shardline" else root.rglob("*.py")
        for f in sorted(files):
            if str(f.relative_to(REPO)) in _ONE_ENGINES:
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                code = re.sub(r"\bfor\s+[\w, ]+\s+in\b", "", line.split("#", 1)[0])  # a loop over names is no test
                if _NAME_TEST.search(code):
                    found.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
