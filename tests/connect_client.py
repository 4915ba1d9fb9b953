"""One Spark Connect client process for the session's Connect commands.

pytest's process holds the classic SparkSession, and pyspark refuses a Connect session
beside it (SESSION_ALREADY_EXIST); so each Connect command ran in a fresh Python, which
imported torch, pyspark and MLflow again (~3 s), opened a new session on the server and
shipped shardline's zip to it; the server then started fresh Python workers for that
session, which imported shardline again. Here one long-lived process runs `jobs.cli.main`
for each command, as a notebook user's successive commands would: the session, the
shipped code and the server's Python workers are reused from one command to the next.
Output and exit code are captured as a subprocess's would be (`cli_inprocess.run_cli`).

Run as a script (`python tests/connect_client.py`), it reads one JSON request per line
on stdin ({"args", "cwd", "env"}, or {"python", "args", "cwd"}: a program as `python -c`
would run it) and answers each with one JSON line ({"code", "stdout",
"stderr"}) on the descriptor that was its stdout; anything else the process prints goes
to its stderr, which the parent keeps in a log file.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path


class ConnectClient:
    """The parent's side: `run(*args, cwd=..., env=...)` like conftest's `shardline()`."""

    def __init__(self, log: Path):
        self.log = log
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        # pyspark's functions pick their Connect implementation while this is set; a fresh
        # CLI process gets it from its first remote session, this one keeps it between commands.
        env["SPARK_CONNECT_MODE_ENABLED"] = "1"
        with open(self.log, "ab") as log:
            return subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=env, cwd=self.log.parent, text=True,
            )  # fmt: skip

    def run(self, *args: str, cwd: Path, env: dict | None = None, timeout: float = 600):
        return self._ask({"args": list(args), "cwd": str(cwd), "env": env or {}}, ["shardline", *args], timeout)

    def python(self, code: str, *argv: str, cwd: Path, timeout: float = 600):
        """`python -c CODE ARGV...` as a subprocess would run it, in this client process: a
        user's own Connect program (the estimators) on the session the CLI commands share."""
        return self._ask({"python": code, "args": list(argv), "cwd": str(cwd), "env": {}}, ["python", "-c", *argv],
                         timeout)

    def _ask(self, request: dict, args: list[str], timeout: float):
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        proc = self._proc
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(
                f"the Connect client process {'gave no answer in %g s' % timeout if not ready else 'died'} "
                f"running {' '.join(args)}; its log ends:\n{self.log_tail()}"
            )
        reply = json.loads(line)
        return subprocess.CompletedProcess(args, reply["code"], reply["stdout"], reply["stderr"])

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.stdin.close()  # its loop ends at end of input, after the command it may be running
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (threads outliving a command, the JVM-less client's logs) go to the log
    sys.stdout = os.fdopen(1, "w", buffering=1)
    from cli_inprocess import run_cli, run_python  # this folder is sys.path[0] when run as a script

    for request in sys.stdin:
        req = json.loads(request)
        if "python" in req:
            code, out, err = run_python(req["python"], req["args"], req["cwd"])
        else:
            code, out, err = run_cli(req["args"], req["cwd"], req["env"])
        answers.write(json.dumps({"code": code, "stdout": out, "stderr": err}) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
