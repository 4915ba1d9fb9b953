"""The CLI (`jobs.cli.main`), or a `python -c` program, run inside a Python that is already
up, with its output and exit code captured as a subprocess's would be. Used by this test process
(`conftest.shardline_here`) and by the Spark Connect client process (`connect_client`).
No pytest here: the client process imports it on its own."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path


def run_cli(args: list[str], cwd: Path | str, env: dict | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `shardline ARGS` run in `cwd`. The working folder and
    environment are put back afterwards, whatever the command set."""
    from shardline.jobs.cli import main

    return _as_a_process(lambda: main(list(args)), cwd, env)


def run_python(program: str, argv: list[str], cwd: Path | str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -c PROGRAM ARGV...` run in `cwd`, in this process
    (the Connect client's: a user's own program on the session the CLI commands share). An
    uncaught exception is a traceback on stderr and exit code 1, as in a process."""
    import traceback

    def program_main() -> None:
        saved_argv, sys.argv = sys.argv, ["-c", *argv]
        try:
            exec(compile(program, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        except Exception:  # noqa: BLE001 (as the interpreter would: printed, exit code 1)
            traceback.print_exc()
            raise SystemExit(1) from None
        finally:
            sys.argv = saved_argv

    return _as_a_process(program_main, cwd, None)


def _as_a_process(main, cwd: Path | str, env: dict | None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `main()` run as a fresh process would run it: in `cwd`,
    with `env` added and no tracking URI; the working folder and environment put back after."""
    out, err, saved_env, saved_cwd = io.StringIO(), io.StringIO(), dict(os.environ), os.getcwd()
    # As in a fresh process: the default store is cwd's, whatever an earlier command set in MLflow.
    forget_tracking_uri()
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.update(env or {})
    os.chdir(cwd)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        forget_tracking_uri()  # the command's store, set for the process: the environment's again
        os.chdir(saved_cwd)
        for key in set(os.environ) - set(saved_env):  # key by key: other threads read it meanwhile
            del os.environ[key]
        os.environ.update({k: v for k, v in saved_env.items() if os.environ.get(k) != v})
    return code, out.getvalue(), err.getvalue()


def forget_tracking_uri() -> None:
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(None)
