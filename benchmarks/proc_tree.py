"""Peak RSS, CPU seconds and disk bytes written of this process and every process under it, sampled from
/proc while a stage runs: the driver, Spark's JVM and its Python workers, Dask's workers,
the ranks. A process is named by its role (its command line); a role's figure lists each
process's own peak, so a rank that grows shows as that rank.

Sampling misses what a process does between two samples (every EVERY_S) and a process
that lives shorter than that: peaks err low by what grows and falls within that time, disk
bytes by what a short-lived process wrote.
"""

from __future__ import annotations

import os
import threading

import psutil

EVERY_S = 0.2


def role(p: psutil.Process, root: int) -> str:
    """driver, spark_jvm, spark_python (the daemon and its workers: tasks and ranks),
    dask_worker (a worker process: its tasks and a rank), dask_nanny, rank (a local
    launcher's), other."""
    if p.pid == root:
        return "driver"
    try:
        cmd = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    if "java" in cmd and "org.apache.spark" in cmd:
        return "spark_jvm"
    if "pyspark.daemon" in cmd or "pyspark/daemon" in cmd or "pyspark.worker" in cmd:
        return "spark_python"
    if "multiprocessing.spawn" in cmd or "multiprocessing.forkserver" in cmd:
        # A LocalCluster's worker processes (their nannies live in the driver) or a local
        # launcher's ranks: the caller says which it started (`spawned_as`).
        return "spawned"
    return "other"


class TreeSampler:
    """Sample the process tree under `root` every EVERY_S seconds in a thread, between
    start() and stop(); stop() returns the figures."""

    def __init__(self, root: int | None = None, spawned_as: str = "worker"):
        self.root = root or os.getpid()
        self.spawned_as = spawned_as
        self._peak: dict[int, float] = {}  # pid -> MB
        self._roles: dict[int, str] = {}
        self._io_first: dict[int, int] = {}
        self._io_last: dict[int, int] = {}
        self._cpu_first: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._total_peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TreeSampler:
        self._sample(first=True)
        self._thread = threading.Thread(target=self._loop, name="shardline-proc-tree", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return self.figures()

    def _loop(self) -> None:
        while not self._stop.wait(EVERY_S):
            self._sample()

    def _sample(self, first: bool = False) -> None:
        try:
            me = psutil.Process(self.root)
            procs = [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total = 0.0
        for p in procs:
            try:
                rss = p.memory_info().rss / 1e6
                written = p.io_counters().write_bytes
                cpu = sum(p.cpu_times()[:2])  # user + system, of its own threads
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if p.pid not in self._roles:
                r = role(p, self.root)
                self._roles[p.pid] = self.spawned_as if r == "spawned" else r
                # A process alive at the start counts from there; a newer one from zero.
                self._io_first[p.pid] = written if first else 0
                self._cpu_first[p.pid] = cpu if first else 0.0
            self._peak[p.pid] = max(self._peak.get(p.pid, 0.0), rss)
            self._io_last[p.pid] = written
            self._cpu_last[p.pid] = cpu
            total += rss
        self._total_peak = max(self._total_peak, total)

    def figures(self) -> dict:
        """peak_rss_mb: {role: [each process's peak, largest first]}; tree_peak_rss_mb: the
        largest sum seen at once; disk_written_bytes: bytes the tree caused to be written;
        cpu_s: CPU seconds of the tree (by role in cpu_s_by_role): on a busy machine the work
        done, which wall time is not."""
        by_role: dict[str, list[float]] = {}
        cpu_by_role: dict[str, float] = {}
        for pid, mb in self._peak.items():
            by_role.setdefault(self._roles[pid], []).append(round(mb, 1))
            used = max(0.0, self._cpu_last[pid] - self._cpu_first[pid])
            cpu_by_role[self._roles[pid]] = cpu_by_role.get(self._roles[pid], 0.0) + used
        return {
            "peak_rss_mb": {k: sorted(v, reverse=True) for k, v in sorted(by_role.items())},
            "tree_peak_rss_mb": round(self._total_peak, 1),
            "disk_written_bytes": sum(max(0, self._io_last[p] - self._io_first[p]) for p in self._io_last),
            "cpu_s": round(sum(cpu_by_role.values()), 3),
            "cpu_s_by_role": {k: round(v, 3) for k, v in sorted(cpu_by_role.items())},
        }
