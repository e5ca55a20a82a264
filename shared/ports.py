"""Ports for the servers the project starts on this machine (the dev stack, the tests): free when named, and outside the
kernel's ephemeral range, so no outgoing connection's source port can take one before its server binds it."""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000
"""Below it sit the fixed ports of the programs a node runs (the kubelet's 10250, kube-proxy's 10249 and 10256)."""
ATTEMPTS = 1000

_handed_out: set[int] = set()
"""Ports this process has named already: a probe may see one free again before its server has bound it."""
_draw = random.SystemRandom()  # never the `random` module's state, which hypothesis seeds alike in every process


def free_port() -> int:
    """A port free now on every address and not named before by this process. A port the kernel picks (bind to 0) comes
    from the ephemeral range, where any connection made in the meantime may take it as its source port; a random one
    outside it can only be taken by another caller drawing the same number, a chance of about 1 in 17000."""
    pool = _pool()
    for _ in range(ATTEMPTS):
        port = _draw.choice(pool)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise OSError(errno.EADDRINUSE, f"no free port among {ATTEMPTS} drawn from {len(pool)} outside the ephemeral range")


def _pool() -> list[int]:
    low, high = _ephemeral_range()
    pool = [port for port in range(LOWEST, 65536) if not low <= port <= high]
    return pool or list(range(LOWEST, 65536))


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(field) for field in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _bindable(port: int) -> bool:
    """Nothing holds `port` on any address: the wildcard bind conflicts with a socket bound to loopback alone too."""
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
