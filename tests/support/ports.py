"""Free loopback ports for servers that must listen on a port chosen before they start.

A port that was free when a test picked it must still be free when its server
binds it, maybe seconds later. Port 0 picks from the kernel's ephemeral range,
the same range every outgoing connection and every other ``bind(0)`` draws
from, so another test worker's socket can take it meanwhile (seen: a P2P node
exiting with "address in use"). :func:`free_port` hands out ports below that
range instead, from a slice of its own per pytest-xdist worker: the kernel
never gives those away, and two workers never pick the same one. A port is
checked free (bound once) before it is handed out.
"""

from __future__ import annotations

import itertools
import os
import socket

#: Ports from here up, one slice per xdist worker (gw0, gw1, ...).
_BASE = 20000
_SLICE = 1000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = name.removeprefix("gw")
    return int(digits) if digits.isdigit() else 0


_START = _BASE + _worker_index() * _SLICE
_CURSOR = itertools.count()
#: This process's slice lies wholly below the ephemeral range (else: port 0).
_USE_SLICE = _ephemeral_low() >= _START + _SLICE


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A loopback TCP port that is free now and that no ``bind(0)`` will take meanwhile."""
    if _USE_SLICE:
        for _ in range(_SLICE):
            port = _START + next(_CURSOR) % _SLICE
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        picked: int = sock.getsockname()[1]
        return picked
