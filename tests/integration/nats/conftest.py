"""Fixtures of the NATS transport tests: a dedicated nats-server, real apps, an engine.

Every test gets its own ``nats-server -js`` (``nats_server_factory``: a fresh
store, so streams never leak between tests, and the test may kill or restart
it), its own shared-memory directory, and real ``CoordinatorApp`` /
``StorageApp`` servers started through the chassis on the session's
coordinator loop thread (one loop for every in-process gRPC server, see
``coord_loop``). Everything is stopped at the end, also when the test fails.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh.coordinator.app import CoordinatorApp
from kvmesh.rpc.server import Server
from kvmesh.storage.app import StorageApp
from kvmesh.storage.config import StorageConfig
from tests.integration.coordinator.conftest import coord_config, coord_loop
from tests.integration.coordinator.support import Clients, Coord
from tests.integration.storage.support import Engine, Node
from tests.support.harness import ServerThread, server_thread
from tests.support.servers import ServerProcess

__all__ = ["Fleet", "coord_loop"]

MIB = 1 << 20


class Fleet:
    """Starts in-process coordinators and storage nodes wired to one NATS server."""

    def __init__(
        self,
        thread: ServerThread,
        node_thread: ServerThread,
        nats: ServerProcess,
        tmp_path: Path,
        shm_root: Path,
    ) -> None:
        self.thread = thread
        # Nodes get their own loop: a node's stop deregisters with a blocking call to
        # the coordinator, which would deadlock on the coordinator's own loop.
        self.node_thread = node_thread
        self.nats = nats
        self.tmp_path = tmp_path
        self.shm_root = shm_root
        self._servers: list[Server] = []
        self._clients: list[Clients] = []
        self._nodes: list[Node] = []
        self._engines: list[Engine] = []

    @property
    def nats_url(self) -> str:
        """``nats://127.0.0.1:PORT`` of this test's server."""
        return self.nats.url

    def coordinator(self, **overrides: Any) -> Coord:
        """A coordinator reading the NATS stream (``nats_url`` overridable)."""
        settings: dict[str, Any] = {"nats_url": self.nats_url}
        settings.update(overrides)
        server = self.thread.start(coord_config(**settings), CoordinatorApp)
        self._servers.append(server)
        clients = Clients.connect(server.target)
        self._clients.append(clients)
        return Coord(self.thread, server, clients)

    def stop_coordinator(self, coord: Coord) -> None:
        """Stop a coordinator's server (its app writes the final checkpoint, if any)."""
        self.thread.stop(coord.server, grace=0.1)
        if coord.server in self._servers:
            self._servers.remove(coord.server)

    def storage(self, instance_id: str = "", **overrides: Any) -> Node:
        """A storage node (disk L2) publishing its cache events to NATS."""
        n = len(self._nodes)
        settings: dict[str, Any] = {
            "port": 0,
            "metrics_port": -1,
            "grace_seconds": 0.2,
            "instance_id": instance_id or f"nats-{uuid.uuid4().hex[:10]}",
            "data_dir": str(self.tmp_path / f"node{n}"),
            "l1_size_bytes": 16 * MIB,
            "l1_segment_bytes": 4 * MIB,
            "shm_dir": str(self.shm_root / "l1"),
            "allowed_memory_dir": str(self.shm_root / "engine"),
            "l2": ["disk"],
            "max_chunks_per_request": 64,
            "event_flush_ms": 5,
            "heartbeat_seconds": 0.5,
            "event_transport": "nats",
            "nats_url": self.nats_url,
        }
        settings.update(overrides)
        server = self.node_thread.start(StorageConfig(**settings), StorageApp)
        node = Node(self.node_thread, server)
        self._nodes.append(node)
        return node

    def engine(self, node: Node) -> Engine:
        """An engine's KV cache file, registered with ``node``."""
        engine = Engine(self.shm_root / "engine", f"eng-{uuid.uuid4().hex[:8]}")
        self._engines.append(engine)
        node.register(engine)
        return engine

    def close(self) -> None:
        """Stop the nodes, then every coordinator; close clients and engines."""
        for node in self._nodes:
            node.close()
        for server in list(reversed(self.node_thread.servers)):
            with contextlib.suppress(Exception):  # already stopped by the test
                self.node_thread.stop(server, grace=0.1)
        for clients in self._clients:
            clients.close()
        for server in reversed(self._servers):
            with contextlib.suppress(Exception):  # already stopped by the test
                self.thread.stop(server, grace=0.1)
        for engine in self._engines:
            engine.close()


@pytest.fixture
def nats(nats_server_factory: Callable[[], ServerProcess]) -> ServerProcess:
    """This test's own ``nats-server -js``."""
    return nats_server_factory()


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """This test's directory under /dev/shm (L1 segments, engine files)."""
    root = Path("/dev/shm") / f"kvmesh-nats-it-{uuid.uuid4().hex[:12]}"
    (root / "l1").mkdir(parents=True)
    (root / "engine").mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def fleet(
    coord_loop: ServerThread, nats: ServerProcess, tmp_path: Path, shm_root: Path
) -> Iterator[Fleet]:
    """Coordinators (on the shared loop) and nodes (on this test's) wired to ``nats``."""
    with server_thread() as node_thread:
        fleet = Fleet(coord_loop, node_thread, nats, tmp_path, shm_root)
        try:
            yield fleet
        finally:
            fleet.close()
