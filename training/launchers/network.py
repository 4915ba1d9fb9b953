"""Which network interface a rank's collectives use (training.socket_ifname).

gloo and NCCL pick the address to listen on from the host name unless told an
interface: where the host name resolves to loopback (an /etc/hosts line many
images carry), ranks on different hosts advertise 127.0.0.1 to each other and
never connect. GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name the interface; they
are read when the process group starts, so they are set in the rank's process
just before `init_process_group` and put back after (a Spark Python worker or a
Dask worker outlives the job and may run another one).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from shardline.foundation.environ import restored
from shardline.foundation.errors import ConfigError

VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def check_interfaces(names: str) -> None:
    """Every comma-separated name must be an interface of this host: a missing one fails
    here in one line naming the setting and the host, not deep in gloo's C++."""
    present = {name for _, name in socket.if_nameindex()}
    missing = [n for n in names.split(",") if n not in present]
    if missing:
        raise ConfigError(
            f"training.socket_ifname {names!r}: no interface {', '.join(missing)} on host "
            f"{socket.gethostname()} (it has {', '.join(sorted(present))})"
        )


@contextmanager
def socket_interface(names: str | None) -> Iterator[None]:
    """Export `names` as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME inside the block.

    None leaves the environment as it is (a value the cluster set, e.g. through
    spark.executorEnv, still applies).
    """
    if not names:
        yield
        return
    check_interfaces(names)
    with restored(VARIABLES):
        os.environ.update(dict.fromkeys(VARIABLES, names))
        yield
