"""Fixtures of the coordinator's integration tests: real coordinators on loopback ports.

``make_coord(**config)`` starts a ``CoordinatorApp`` through the chassis on a
free port of this process (one event-loop thread for the whole session) and
stops it at the end of the test, also when the test fails. Defaults suit
tests: chunk size 4 (token queries stay short), timers off (the health sweep
and the eviction loop run only where a test asks), eviction ready 0.1 s
after start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from kvmesh.coordinator.app import CoordinatorApp
from kvmesh.coordinator.config import CoordinatorConfig
from tests.integration.coordinator.support import Clients, Coord
from tests.support.harness import ServerThread, server_thread

CHUNK = 4

CoordFactory = Callable[..., Coord]


def coord_config(**overrides: Any) -> CoordinatorConfig:
    """A test coordinator's config."""
    settings: dict[str, Any] = {
        "port": 0,
        "metrics_port": -1,
        "grace_seconds": 0.2,
        "chunk_size": CHUNK,
        "health_check_interval_seconds": 0.0,
        "eviction_check_interval_seconds": 0.0,
        "heartbeat_interval_seconds": 0.1,
        "instance_timeout_seconds": 30.0,
        "checkpoint_interval_seconds": 0.0,
    }
    settings.update(overrides)
    return CoordinatorConfig(**settings)


@pytest.fixture(scope="session")
def coord_loop() -> Iterator[ServerThread]:
    """One event loop thread hosting every in-process coordinator of these tests.

    An idle ``grpc.aio`` channel lives as long as the loop: gRPC shuts its
    asyncio poller down whenever the last aio object goes away and starts a
    new one with the next, and a callback of the old poller still queued on
    the loop then fails ("Bad file descriptor", logged by asyncio). Keeping
    one object alive keeps one poller for the whole session.
    """

    async def open_keepalive() -> grpc.aio.Channel:
        return grpc.aio.insecure_channel("127.0.0.1:9")

    with server_thread() as thread:
        keepalive = thread.run(open_keepalive())
        try:
            yield thread
        finally:
            thread.run(keepalive.close())


@pytest.fixture
def make_coord(coord_loop: ServerThread) -> Iterator[CoordFactory]:
    """Start coordinators: ``make_coord(eviction_ratio=0.5, checkpoint_path=...)``."""
    started: list[Coord] = []

    def start(**overrides: Any) -> Coord:
        server = coord_loop.start(coord_config(**overrides), CoordinatorApp)
        coord = Coord(coord_loop, server, Clients.connect(server.target))
        started.append(coord)
        return coord

    try:
        yield start
    finally:
        for coord in reversed(started):
            if coord.server in coord_loop.servers:
                coord.stop()


@pytest.fixture
def coord(make_coord: CoordFactory) -> Coord:
    """A coordinator with the test defaults."""
    return make_coord()
