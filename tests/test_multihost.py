"""The multi-host bed (tests/multihost_bed.py) as a test: two worker hosts and a services host in
network namespaces with private tmpfs working folders, the quickstart on a Spark standalone
cluster over them with every path on s3://, a rank on host B killed mid-training and resumed
from the bucket onto the uninterrupted run's weights; the Dask launcher likewise. Needs root
(CI is root). Nothing of the bed may be left afterwards, also when it failed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from .conftest import REPO
from .multihost_hosts import PREFIX, our_namespaces, sweep

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="makes network and mount namespaces: needs root"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "unshare", "nsenter")),
                       reason="needs iproute2's `ip`, and util-linux's unshare and nsenter"),
]


def _bed_processes() -> list[str]:
    """Processes of a bed: anything still running from its temp dir or in its namespaces."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if "shardline-bed-" in ln and "ps -eo" not in ln]


@pytest.mark.timeout(2400)
def test_quickstart_across_two_hosts_resumes_from_the_bucket_after_a_host_loses_its_worker():
    assert our_namespaces() == [], "a bed from an earlier run is still there"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.multihost_bed", "--dask", "--timeout", "2100"],
            cwd=REPO, capture_output=True, text=True, timeout=2300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        left = sweep()  # only if the bed could not clean up itself (it was SIGKILLed)
    assert left == []
    out = proc.stdout + proc.stderr
    print("\n".join(ln for ln in out.splitlines() if ln.startswith("[bed]")))  # what ran, how long (-s)
    # Cleaned up whatever happened: no namespace, and no process of the bed.
    assert our_namespaces(PREFIX) == [], out[-3000:]
    assert _bed_processes() == [], out[-3000:]
    assert "[bed] cleaned up" in out, out[-3000:]
    assert proc.returncode == 0, out[-6000:]
    assert "[bed] working folders are private to each host" in out
    assert "[bed] spark: a rank on host B killed mid-training" in out
    assert "[bed] dask: a rank on host B killed" in out
