"""Health that tells the truth: a storage node says whether its coordinator link is up.

``grpc.health.v1`` has no details field, so a storage node with a coordinator
serves one more health name, ``kvmesh.storage.v1.CoordinatorLink``: SERVING
while its event link to the coordinator is connected, NOT_SERVING while not.
The node's own status (overall and StorageService) stays SERVING: it serves
its engines with or without a coordinator. A node without a coordinator does
not serve the name (NOT_FOUND).

A real ``kvmesh storage`` process and a real ``kvmesh coordinator`` process:
connected → SERVING; coordinator SIGKILLed → NOT_SERVING; coordinator
restarted on the same port → SERVING again, each change logged once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.storage.app import COORDINATOR_LINK, SERVICE_NAME
from tests.integration.coordinator.support import CliProcess
from tests.integration.storage.conftest import NodeFactory, ShmDirs
from tests.support.ports import free_port
from tests.support.waiting import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LINK_UP = "event link to the coordinator at"


def _health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(reply.status)


def _statuses(target: str) -> tuple[int, int, int]:
    """Overall, StorageService, CoordinatorLink."""
    return _health(target, ""), _health(target, SERVICE_NAME), _health(target, COORDINATOR_LINK)


ProcessFactory = Callable[..., CliProcess]


@pytest.fixture
def processes() -> Iterator[ProcessFactory]:
    """``CliProcess`` handles (not started); every one is killed at the end."""
    made: list[CliProcess] = []

    def make(service: str, port: int, *args: str) -> CliProcess:
        proc = CliProcess(service, port, list(args))
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in reversed(made):
            proc.stop()  # SIGTERM: a storage node removes its L1 segments


def _coordinator_args(tmp_path: Path) -> list[str]:
    return [
        "--log-level", "WARNING",
        "--grace-seconds", "0.5",
        "--checkpoint-path", str(tmp_path / "coordinator.ckpt"),
        "--metadata-path", str(tmp_path / "metadata.json"),
        "--checkpoint-interval-seconds", "0",
    ]  # fmt: skip


@pytest.mark.parametrize("service", ["storage", "node"])
def test_coordinator_link_follows_the_coordinator(
    processes: ProcessFactory, shm_dirs: ShmDirs, tmp_path: Path, service: str
) -> None:
    """``kvmesh storage``, and ``kvmesh node`` (storage and gateway in one process)."""
    port = free_port()
    coordinator = processes("coordinator", port, *_coordinator_args(tmp_path))
    coordinator.start()
    storage = processes(
        service,
        free_port(),
        "--log-level", "INFO",
        "--coordinator-target", coordinator.target,
        "--instance-id", f"link-{tmp_path.name[-12:]}".replace("_", "-"),
        "--data-dir", str(tmp_path / "storage"),
        "--shm-dir", str(shm_dirs.l1),
        "--allowed-memory-dir", str(shm_dirs.engine),
        "--l2", "none",
        "--l1-size-bytes", str(8 << 20),
        "--l1-segment-bytes", str(4 << 20),
    )  # fmt: skip
    storage.start()
    target = storage.target

    def log_count(what: str) -> int:
        return storage.log(limit=1 << 20).count(what)

    wait_until(
        lambda: _statuses(target) == (SERVING, SERVING, SERVING),
        timeout=60,
        message=f"CoordinatorLink never SERVING:\n{storage.log()}",
    )
    wait_until(lambda: log_count(f"{LINK_UP} {coordinator.target} is up") == 1, timeout=30)

    coordinator.kill()  # SIGKILL
    # The link is down; the node itself keeps serving its engines.
    wait_until(
        lambda: _statuses(target) == (SERVING, SERVING, NOT_SERVING),
        timeout=60,
        message=f"CoordinatorLink still SERVING after the coordinator died:\n{storage.log()}",
    )
    wait_until(lambda: log_count(f"{LINK_UP} {coordinator.target} is down") == 1, timeout=30)

    coordinator.start()  # the same port
    wait_until(
        lambda: _statuses(target) == (SERVING, SERVING, SERVING),
        timeout=60,
        message=f"CoordinatorLink not SERVING after the coordinator came back:\n{storage.log()}",
    )
    wait_until(lambda: log_count(f"{LINK_UP} {coordinator.target} is up") == 2, timeout=30)
    # Once each way: no repeats while the link was down or after it came back.
    assert log_count(f"{LINK_UP} {coordinator.target} is down") == 1, storage.log()


def test_a_node_without_a_coordinator_does_not_serve_the_link(make_node: NodeFactory) -> None:
    node = make_node()
    target = node.server.target
    assert _health(target, "") == SERVING
    assert _health(target, SERVICE_NAME) == SERVING
    with pytest.raises(grpc.RpcError) as missing:
        _health(target, COORDINATOR_LINK)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
