"""free_port: ports below the kernel's ephemeral range, a slice per xdist worker."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.support.harness import REPO_ROOT
from tests.support.ports import _SLICE as SLICE
from tests.support.ports import free_port


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(5)]
    assert len(set(ports)) == 5
    assert all(port < _ephemeral_low() for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped() -> None:
    """Held by a listener, a port of the slice is passed over when the picks come round."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        picks = [free_port() for _ in range(SLICE)]  # one whole turn of the slice
    assert taken not in picks


def test_two_workers_draw_from_different_slices() -> None:
    def ports_of(worker: str) -> set[int]:
        script = "import json\nfrom tests.support.ports import free_port\n"
        script += "print(json.dumps([free_port() for _ in range(20)]))"
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO_ROOT,
            env={"PYTEST_XDIST_WORKER": worker, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return set(json.loads(done.stdout))

    assert ports_of("gw0").isdisjoint(ports_of("gw1"))
