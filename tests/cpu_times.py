"""CPU seconds per test, a figure that a loaded machine changes far less than wall time:
`pytest -p tests.cpu_times ...` writes each test's CPU seconds (setup + call + teardown, of
pytest's process and every process under it) to `.pytest_cache/shardline/cpu_times.tsv` and
prints the slowest files and tests at the end.

On this shared 2-core machine a run's wall time swings with whatever else runs (an idle
quick tier of 5 min took 11 beside two CPU hogs); the CPU a test spends starting JVMs,
importing torch and training does not. It is a tool for comparing two versions of a test,
never an assertion (no test depends on speed).

A process's CPU is counted while it is alive under pytest (psutil, its own and its reaped
children's times) and, once pytest reaps it, through RUSAGE_CHILDREN; a daemon that left
the tree (setsid and reparented) is counted only while it was still under it."""

from __future__ import annotations

import os
import resource
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

SHOWN = 15
_times: dict[str, float] = {}


def _tree_cpu() -> float:
    """CPU seconds of this process, of its reaped children, and of every live descendant
    (each counted with its own reaped children). A descendant that ended since the last
    look, reaped by a live one, is in that one's children times."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    try:
        children = psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        try:
            t = child.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _tree_cpu()
    yield
    _times[item.nodeid] = _tree_cpu() - start


def pytest_terminal_summary(terminalreporter):
    if not _times:
        return
    out = Path(terminalreporter.config.rootpath) / ".pytest_cache" / "shardline" / "cpu_times.tsv"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(f"{s:.2f}\t{n}\n" for n, s in sorted(_times.items(), key=lambda x: -x[1])))
    files: dict[str, float] = defaultdict(float)
    for name, seconds in _times.items():
        files[name.split("::")[0]] += seconds
    tr = terminalreporter
    tr.write_line(f"cpu-times: {sum(_times.values()):.0f} CPU-s in {len(_times)} tests ({out})")
    for name, seconds in sorted(files.items(), key=lambda x: -x[1])[:SHOWN]:
        tr.write_line(f"  {seconds:7.1f} CPU-s  {name}")
    for name, seconds in sorted(_times.items(), key=lambda x: -x[1])[:SHOWN]:
        tr.write_line(f"  {seconds:7.1f} CPU-s  {name}")
