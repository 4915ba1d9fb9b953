"""The multi-host test bed (issue #14 item 4): `sudo python -m tests.multihost_bed`.

Three hosts on this machine (tests/multihost_hosts.py): a services host S and worker
hosts A and B, each with its own network namespace and a private tmpfs working folder.
S runs the S3 server (moto), an MLflow server with proxied artifacts in the bucket, a
Spark standalone master, a Dask scheduler and the driver (the shardline CLI); A and B
each run one Spark worker and one Dask worker. Then, with every path on s3://:

1. `shardline run` the quickstart (prepare, train on a barrier stage over A and B,
   register, score); when the first checkpoint is in the bucket, the rank running on
   host B (a Spark executor's Python worker) is SIGKILLed; the job must relaunch and
   resume from the bucket.
2. `shardline train` the same config uninterrupted, checkpoints elsewhere in the bucket.
3. (--dask) `shardline train --launcher dask`: the rank on host B (a process its Dask
   worker forked) is SIGKILLed after the first checkpoint.
The final checkpoints of 1 and 3 must hold exactly the weights of 2. Every namespace and
process is removed at the end, also on failure or Ctrl-C; exit 0 only when all held.

The outer process (the machine's namespaces) makes and removes the hosts; the checks
run inside host S (`--inside`), where the services' addresses are reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"
UP_WITHIN_S = 300  # a JVM or worker starting on a loaded 2-core machine takes minutes
S3_PORT, MLFLOW_PORT, SPARK_PORT, SPARK_UI, DASK_PORT = 9000, 5000, 7077, 8080, 8786  # each host's own ports


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.inside:
        from .multihost_hosts import Bed

        return Inside(Bed.from_env(json.loads(os.environ["SHARDLINE_BED"])), args).run()
    return outside(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.multihost_bed", description=__doc__.split("\n\n")[0])
    p.add_argument("--dask", action="store_true", help="also train on the Dask cluster with its B worker killed")
    p.add_argument("--rows", type=int, default=40_000, help="quickstart rows (the config says 200000)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1500, help="seconds before the run is stopped and cleaned")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    return p


def outside(args) -> int:
    from .multihost_hosts import create, destroy

    if os.geteuid() != 0:
        print("error: the multi-host bed makes network and mount namespaces: run it as root", file=sys.stderr)
        return 2
    start = time.monotonic()
    # SIGTERM (a CI runner's stop) unwinds like Ctrl-C, so the cleanup below runs.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    bed = create(Path(tempfile.mkdtemp(prefix="shardline-bed-")))
    print(f"[bed] hosts up: {', '.join(f'{h.name}={h.address} ({h.netns})' for h in bed.hosts.values())}",
          flush=True)
    code = 1
    inner = None
    try:
        cmd = [sys.executable, "-m", "tests.multihost_bed", "--inside", *_passed_on(args)]
        env = {**os.environ, "SHARDLINE_BED": json.dumps(bed.to_env()),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        from .multihost_hosts import on_host

        inner = on_host(bed.hosts["s"], cmd, bed.work, env=env)
        code = inner.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"[bed] FAILED: not done within {args.timeout:.0f} s", flush=True)
    except KeyboardInterrupt:
        print("[bed] FAILED: interrupted", flush=True)
    finally:
        if inner is not None and inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
            inner.wait()
        left = destroy(bed)
    if left:
        print(f"[bed] FAILED to clean up: {left}", flush=True)
        code = code or 1
    else:
        print("[bed] cleaned up: no namespace, process or file of the bed is left", flush=True)
    print(f"[bed] {'PASSED' if code == 0 else 'FAILED'} in {time.monotonic() - start:.0f} s", flush=True)
    return code


def _passed_on(args) -> list[str]:
    return [*(["--dask"] if args.dask else []), "--rows", str(args.rows), "--epochs", str(args.epochs)]


class Inside:
    """Runs in host S: starts the services and daemons, runs the jobs, checks the results."""

    def __init__(self, bed, args):
        self.bed, self.args = bed, args
        self.s = bed.hosts["s"]
        self.logs = Path(bed.work) / "logs"  # S's own tmpfs: gone with the bed, printed on failure
        self.logs.mkdir()
        self.procs: list[subprocess.Popen] = []
        s3 = f"http://{self.s.address}:{S3_PORT}"
        self.env = {
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(REPO),  # the code is installed on every host; the working folders are not shared
            "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
            "AWS_ENDPOINT_URL": s3, "AWS_ACCESS_KEY_ID": "bed", "AWS_SECRET_ACCESS_KEY": "bed",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        os.environ.update(self.env)
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        self.bucket = "s3://bed"

    def run(self) -> int:
        start = time.monotonic()
        try:
            self.check_private_folders()
            self.start_daemons()
            print(f"[bed] services and clusters up in {time.monotonic() - start:.0f} s", flush=True)
            from .multihost_jobs import run_jobs

            run_jobs(self)
            return 0
        except Exception as e:
            print(f"[bed] FAILED: {type(e).__name__}: {e}", flush=True)
            for log in sorted(self.logs.iterdir()):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}", flush=True)
            return 1
        finally:
            self.stop()

    # -- hosts and daemons ------------------------------------------------------------------
    def start(self, host: str, name: str, cmd: list[str], **env: str) -> subprocess.Popen:
        from .multihost_hosts import on_host

        log = open(self.logs / f"{name}.log", "wb")
        proc = on_host(self.bed.hosts[host], cmd, self.bed.work, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, **self.env, **env})
        self.procs.append(proc)
        return proc

    def wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + UP_WITHIN_S
        while not _quietly(ready):
            dead = [p.args[-1] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{what}: a daemon exited: {dead}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not within {UP_WITHIN_S} s")
            time.sleep(0.3)

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.2)

    def check_private_folders(self) -> None:
        """A file made in S's working folder is not in A's or B's (nor theirs in S's)."""
        from .multihost_hosts import run_on_host

        (Path(self.bed.work) / "made-on-s").write_text("s")
        for h in ("a", "b"):
            seen = run_on_host(self.bed.hosts[h], ["sh", "-c", f"touch made-on-{h} && ls -A"], self.bed.work)
            if seen.split() != [f"made-on-{h}"]:
                raise RuntimeError(f"host {h} sees other hosts' files in its working folder: {seen.split()}")
        if sorted(os.listdir(self.bed.work)) != ["logs", "made-on-s"]:
            raise RuntimeError(f"host s sees {os.listdir(self.bed.work)}")
        print("[bed] working folders are private to each host", flush=True)

    def start_daemons(self) -> None:
        """Every service and cluster daemon, started side by side: each waits only on what it
        needs (a worker on its master or scheduler, the buckets on the S3 server), not on the
        daemons before it; then all of them are waited for."""
        from shardline.foundation.object_stores import s3_client

        s = self.s.address
        self.tracking_uri = f"http://{s}:{MLFLOW_PORT}"
        self.spark_master = f"spark://{s}:{SPARK_PORT}"
        self.dask_address = f"tcp://{s}:{DASK_PORT}"
        self.start("s", "moto", [str(BIN / "moto_server"), "-H", s, "-p", str(S3_PORT)])
        self.start("s", "spark-master", [
            str(BIN / "spark-class"), "org.apache.spark.deploy.master.Master", "--host", s,
            "--port", str(SPARK_PORT), "--webui-port", str(SPARK_UI)], SPARK_LOCAL_IP=s)
        if self.args.dask:
            self.start("s", "dask-scheduler", [str(BIN / "dask"), "scheduler", "--host", s, "--port",
                                               str(DASK_PORT), "--dashboard-address", ":0"])
        # The MLflow server touches its artifact store only when an artifact comes: it need
        # not wait for the S3 server.
        self.start("s", "mlflow", [
            str(BIN / "mlflow"), "server", "--host", s, "--port", str(MLFLOW_PORT), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.bed.work}/mlflow.db",
            "--artifacts-destination", "s3://mlflow/artifacts",
        ], MLFLOW_S3_ENDPOINT_URL=self.env["AWS_ENDPOINT_URL"],
           MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no job runner: 8 processes tracking never uses
        if self.args.dask:
            # A nanny gives up on a scheduler that does not answer within its connect timeout:
            # the workers start once it listens (a second or two, before the master's JVM).
            self.wait(lambda: _listening(s, DASK_PORT), "Dask scheduler")
            for h in ("a", "b"):
                self.start(h, f"dask-worker-{h}", [
                    str(BIN / "dask"), "worker", self.dask_address, "--nworkers", "1", "--nthreads", "1",
                    "--host", self.bed.hosts[h].address, "--no-dashboard",
                    "--local-directory", f"{self.bed.work}/dask-work"])
        # A Spark worker that finds no master retries only seconds later: started once it listens.
        self.wait(lambda: _listening(s, SPARK_PORT), "Spark master")
        for h in ("a", "b"):
            addr = self.bed.hosts[h].address
            self.start(h, f"spark-worker-{h}", [
                str(BIN / "spark-class"), "org.apache.spark.deploy.worker.Worker", self.spark_master,
                "--cores", "1", "--memory", "1g", "--work-dir", f"{self.bed.work}/spark-work",
                "--host", addr, "--webui-port", "8081"], SPARK_LOCAL_IP=addr)
        self.wait(lambda: _listening(s, S3_PORT), "S3 server")
        for bucket in ("bed", "mlflow"):
            s3_client().create_bucket(Bucket=bucket)
        self.wait(lambda: _http_ok(f"{self.tracking_uri}/health"), "MLflow server")
        self.wait(lambda: _alive_spark_workers(f"http://{s}:{SPARK_UI}/json/") == 2, "Spark workers registering")
        if self.args.dask:
            from distributed import Client

            with Client(self.dask_address, timeout="60s") as client:
                self.wait(lambda: len(client.scheduler_info()["workers"]) == 2, "Dask workers registering")


def _quietly(ready) -> bool:
    try:
        return bool(ready())
    except (OSError, ValueError, KeyError):  # ValueError: a Spark master's /json/ still serving HTML
        return False


def _listening(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status == 200


def _alive_spark_workers(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as r:
        return int(json.loads(r.read())["aliveworkers"])


if __name__ == "__main__":
    sys.exit(main())
