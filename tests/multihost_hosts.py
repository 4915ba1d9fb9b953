"""Hosts on one machine for the multi-host test bed (tests/multihost_bed.py): network
namespaces joined by veth pairs, each with a private mount namespace and tmpfs working folder.

Layout (as root; nothing is added to the machine's own namespace but the netns files):

    <prefix>-s  services host: a bridge slbr0 at 10.250.0.254 (S3, MLflow, Spark master,
                Dask scheduler, the driver)
    <prefix>-a  host A: slnet0 at 10.250.0.1, one veth pair to the bridge
    <prefix>-b  host B: slnet0 at 10.250.0.2, one veth pair to the bridge

Both worker hosts name their interface `slnet0`, so one `training.socket_ifname` fits
both. Every host has the same working-folder path, each a tmpfs of its own in the host's
own mount namespace: no host sees another's files, nor the machine's (as real hosts
with the same layout). A host's mount namespace is held by one `sleep` process; every
daemon enters it and the network namespace with `nsenter`. The bridge lives in the
services namespace, where no packet filter exists, so bridged traffic is never filtered
by the machine's rules.

`destroy` kills every process found in the namespaces (`ip netns pids`), whoever started
it, then deletes the namespaces: the veths and the bridge go with them, and each tmpfs
with the last process of its mount namespace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

SUBNET = "10.250.0"
IFNAME = "slnet0"  # the hosts' interface: what training.socket_ifname names
ADDRESSES = {"s": f"{SUBNET}.254", "a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}
PREFIX = "shardline-bed"


@dataclass
class Host:
    name: str  # s, a, b
    netns: str
    address: str
    holder_pid: int  # the process holding the host's mount namespace
    netns_inode: int  # what /proc/<pid>/ns/net of a process on this host points at


@dataclass
class Bed:
    prefix: str
    root: str  # a temp dir on the machine; holds the working-folder mount point
    work: str  # every host's working folder (a tmpfs of its own on each host)
    hosts: dict[str, Host]

    def to_env(self) -> dict:
        return {"prefix": self.prefix, "root": self.root, "work": self.work,
                "hosts": {k: asdict(h) for k, h in self.hosts.items()}}

    @classmethod
    def from_env(cls, d: dict) -> Bed:
        return cls(d["prefix"], d["root"], d["work"], {k: Host(**h) for k, h in d["hosts"].items()})


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=60)


def our_namespaces(prefix: str = PREFIX) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=60).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def create(root: Path) -> Bed:
    """Make the three hosts; on any failure undo what was made and re-raise."""
    prefix = f"{PREFIX}-{uuid.uuid4().hex[:6]}"
    work = root / "work"
    work.mkdir(parents=True)
    bed = Bed(prefix, str(root), str(work), {})
    try:
        names = {h: f"{prefix}-{h}" for h in ADDRESSES}
        for ns in names.values():
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        s = names["s"]
        ip("-n", s, "link", "add", "slbr0", "type", "bridge")
        ip("-n", s, "addr", "add", f"{ADDRESSES['s']}/24", "dev", "slbr0")
        ip("-n", s, "link", "set", "slbr0", "up")
        for h in ("a", "b"):
            ip("link", "add", IFNAME, "netns", names[h], "type", "veth", "peer", "name", f"sl-{h}", "netns", s)
            ip("-n", s, "link", "set", f"sl-{h}", "master", "slbr0", "up")
            ip("-n", names[h], "addr", "add", f"{ADDRESSES[h]}/24", "dev", IFNAME)
            ip("-n", names[h], "link", "set", IFNAME, "up")
        for h, ns in names.items():
            pid = _hold_mount_namespace(ns, work, h)
            bed.hosts[h] = Host(h, ns, ADDRESSES[h], pid, os.stat(f"/run/netns/{ns}").st_ino)
        return bed
    except BaseException:
        destroy(bed)
        raise


def _hold_mount_namespace(netns: str, work: Path, name: str) -> int:
    """A process in `netns` with a private mount namespace where `work` is a fresh tmpfs."""
    script = f'mount -t tmpfs -o size=2g shardline-{name} "$1" && echo ready && exec sleep infinity'
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, "unshare", "--mount", "--propagation", "private",
         "sh", "-c", script, "sh", str(work)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    line = proc.stdout.readline().strip()  # `ip netns exec` and unshare exec: proc.pid is the holder
    if line != "ready":
        proc.kill()
        raise RuntimeError(f"host {name}: could not mount a private tmpfs on {work}: {line or proc.wait()}")
    return proc.pid


def on_host(host: Host, cmd: list[str], cwd: str, **popen) -> subprocess.Popen:
    """Start `cmd` on `host` (its network and mount namespaces, `cwd` seen there), in a session
    of its own so its whole group can be stopped."""
    return subprocess.Popen(
        ["nsenter", "-t", str(host.holder_pid), "-m", "-n", f"--wdns={cwd}", "--", *cmd],
        start_new_session=True, **popen,
    )


def run_on_host(host: Host, cmd: list[str], cwd: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        ["nsenter", "-t", str(host.holder_pid), "-m", "-n", f"--wdns={cwd}", "--", *cmd],
        capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode:
        raise RuntimeError(f"host {host.name}: {cmd} exited {proc.returncode}: {proc.stderr[-1500:]}")
    return proc.stdout


def netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=60).stdout
    return [int(p) for p in out.split()]


def destroy(bed: Bed, grace_s: float = 10) -> list[str]:
    """Stop every process in the bed's namespaces (TERM, then KILL), delete the namespaces and
    the temp dir. Returns what could not be cleaned (empty when all went)."""
    left = remove_namespaces(our_namespaces(bed.prefix), grace_s)
    work = Path(bed.work)
    if work.exists() and any(work.iterdir()):  # a host's files on the machine's disk: a leak
        left.append(f"files in {work} on the machine: {sorted(os.listdir(work))[:5]}")
    subprocess.run(["rm", "-rf", bed.root], check=False, timeout=120)
    return left


def sweep() -> list[str]:
    """Remove whatever beds are left (a bed whose own process was SIGKILLed cannot clean up);
    returns the namespaces it found."""
    found = our_namespaces()
    remove_namespaces(found)
    return found


def remove_namespaces(namespaces: list[str], grace_s: float = 10) -> list[str]:
    """TERM, then KILL, every process in `namespaces`; delete them; return what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for ns in namespaces:
            for pid in netns_pids(ns):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(netns_pids(ns) for ns in namespaces):
            time.sleep(0.2)
    left = [f"process {pid} in {ns}" for ns in namespaces for pid in netns_pids(ns)]
    for ns in namespaces:
        try:
            ip("netns", "del", ns)
        except subprocess.CalledProcessError as e:
            left.append(f"netns {ns}: {e.stderr.strip()}")
    return left + [f"netns {ns}" for ns in namespaces if ns in our_namespaces()]
