"""--json and --json-file: a command's result as one JSON document, on stdout and/or in a file."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from contextlib import contextmanager

import click

from shardline.foundation.errors import ConfigError


def _check_json_file(ctx, _param, path):
    """--json-file's folder must exist: refused before any work, not after it, in one line
    (a ConfigError, exit 2: not click's usage block around it)."""
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ConfigError(f"--json-file {path}: no folder {folder} to write it in")
        ctx.meta["shardline.json_file"] = path
    return path


# Beside --json: under spark-submit the driver's stderr is merged into stdout, so a
# scheduler cannot take the result apart from the progress lines; a file it can.
json_file_option = click.option(
    "--json-file", metavar="PATH", type=click.Path(dir_okay=False), callback=_check_json_file, expose_value=False,
    help="Also write the result as one JSON object to PATH (atomically: complete or absent).",
)


def json_option(fn):
    fn = json_file_option(fn)
    return click.option(
        "--json", "as_json", is_flag=True,
        help="Print the result as one JSON object on stdout; progress stays on stderr.",
    )(fn)


def json_file_path() -> str | None:
    """The running command's --json-file, if given."""
    return click.get_current_context().meta.get("shardline.json_file")


def write_json_file(path: str, document) -> None:
    """`document` as JSON at `path`, atomically: a temporary file beside it, then renamed."""
    import tempfile

    text = json.dumps(document, indent=2, default=str) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".shardline-", suffix=".json", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextmanager
def json_out(as_json: bool):
    """With --json, stdout carries the result alone, as one JSON document: while the work
    runs, whatever prints to stdout (our code, a library, a child process started meanwhile:
    ranks, a JVM, Dask workers) goes to stderr instead. With --json-file the document is
    written to that file too. Yields `emit(result)`."""
    path = json_file_path()
    results: list = []
    if not as_json:
        yield results.append
        if path and results:
            write_json_file(path, jsonable(results[0]))
        return
    sys.stdout.flush()
    saved, saved_fd = sys.stdout, os.dup(1)
    try:
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        yield results.append
    finally:
        sys.stderr.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = saved
    if path:
        write_json_file(path, jsonable(results[0]))
    click.echo(json.dumps(jsonable(results[0]), indent=2, default=str))


def jsonable(result):
    if hasattr(result, "to_dict"):
        return result.to_dict()
    return dataclasses.asdict(result)
