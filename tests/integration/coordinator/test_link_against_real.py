"""The storage link's happy-path tests, run against the real coordinator instead of the fake.

``tests/integration/storage/events`` tests the node's emitter and gRPC
transport against a fake coordinator; the tests that observe it only through
:class:`~tests.support.fake_coordinator.CoordinatorView`
(and ``stop``/``start`` on the same port) run here unchanged against a real
``CoordinatorApp``: :class:`RealCoordinatorHandle` serves the app through
the chassis ``create_server`` and :class:`RealCoordinatorView` answers the
view's questions from the real core (a recording consumer registered on its
broadcaster after the real consumers sees exactly the admitted batches; the
cursors are the gate's).

A restart keeps the app (its core, like a coordinator restored from a
checkpoint) and serves it again on the same port.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.common.convert import key_to_proto
from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, Tier
from kvmesh.coordinator.app import CoordinatorApp
from kvmesh.rpc.server import Server, create_server
from tests.integration.coordinator.conftest import coord_config
from tests.integration.coordinator.support import Clients
from tests.integration.storage.events import test_emitter_over_grpc as link
from tests.integration.storage.events.support import key
from tests.support.fake_coordinator import DEADLINE_S, Cursor
from tests.support.harness import ServerThread, no_thread_left_since
from tests.support.ports import free_port

# The link module's own fixture, so its tests get what they expect.
rig_factory = link.rig_factory


class RealCoordinatorView:
    """``CoordinatorView`` over a real coordinator core."""

    def __init__(self, app: CoordinatorApp) -> None:
        self._app = app
        self._cond = threading.Condition()
        self._admitted: dict[str, list[CacheEventBatch]] = {}
        # Registered after the real consumers, before any traffic: it sees every
        # admitted batch, in admission order, and nothing the gate dropped.
        app.core.broadcaster.register(self, "test-recorder")

    def consume(self, batch: CacheEventBatch) -> None:
        """Record one admitted batch."""
        with self._cond:
            self._admitted.setdefault(batch.instance_id, []).append(batch)
            self._cond.notify_all()

    def fence_instance(self, instance_id: str) -> None:
        """Nothing to fence: the recorder keeps history."""

    def admitted(self, instance_id: str) -> list[CacheEventBatch]:
        """Every batch admitted for ``instance_id``, in admission order."""
        with self._cond:
            return list(self._admitted.get(instance_id, ()))

    def cursor(self, instance_id: str) -> Cursor | None:
        """The gate's cursor for ``instance_id``."""
        info = self._app.core.cursors().get(instance_id)
        return None if info is None else Cursor(info.incarnation, info.last_seq, info.gap_detected)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
        """Block until ``predicate()`` holds (re-checked on every batch, and every 20 ms)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"coordinator condition not met within {timeout} s")
                self._cond.wait(min(left, 0.02))


class RealCoordinatorHandle:
    """A real ``CoordinatorApp`` on a fixed port: start, stop, start again with the same core."""

    def __init__(self, thread: ServerThread, port: int) -> None:
        self._thread = thread
        self.port = port
        self._config = coord_config(port=port)
        self.app = CoordinatorApp(self._config)
        self.state = RealCoordinatorView(self.app)
        self._server: Server | None = None

    @property
    def target(self) -> str:
        """What a client dials."""
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while serving."""
        return self._server is not None

    def start(self) -> None:
        """Serve the app on ``port`` (the same one on every restart)."""

        async def _start() -> Server:
            server = create_server(self._config, self.app)
            await server.start()  # the app's start hook is idempotent
            return server

        self._server = self._thread.run(_start())

    def stop(self, grace: float = 0.0) -> None:
        """Stop serving (open streams end) but keep the app: its state survives."""
        server, self._server = self._server, None
        if server is None:
            return

        async def _stop() -> None:
            await server.health.enter_graceful_shutdown()
            await server.grpc_server.stop(grace)
            # What Server.stop does besides the app's stop: each restart makes its own.
            if server.loop_lag is not None:
                await server.loop_lag.stop()
            if server.metrics is not None:
                server.metrics.close()

        self._thread.run(_stop())

    def close(self) -> None:
        """Stop serving and stop the app."""
        self.stop()
        self._thread.run(self.app.stop())


@pytest.fixture
def real_handle(coord_loop: ServerThread) -> Iterator[RealCoordinatorHandle]:
    """A real coordinator on a fixed free port, not started yet."""
    handle = RealCoordinatorHandle(coord_loop, free_port())
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture
def real(real_handle: RealCoordinatorHandle) -> RealCoordinatorHandle:
    """A serving real coordinator."""
    real_handle.start()
    return real_handle


@pytest.fixture
def no_new_threads() -> Callable[[], None]:
    """As the link tests' fixture: every thread started since the test began has ended."""
    before = set(threading.enumerate())
    return lambda: no_thread_left_since(before)


def test_every_batch_reaches_the_real_coordinator_exactly_once_in_order(
    real: Any, rig_factory: Any, no_new_threads: Callable[[], None]
) -> None:
    link.test_every_batch_reaches_the_coordinator_exactly_once_in_order(
        real, rig_factory, no_new_threads
    )


def test_a_real_coordinator_restart_on_the_same_port_loses_nothing(
    real: Any, rig_factory: Any
) -> None:
    link.test_a_coordinator_restart_on_the_same_port_loses_nothing(real, rig_factory)


def test_the_emitter_buffers_until_the_real_coordinator_appears(
    real_handle: Any, rig_factory: Any
) -> None:
    link.test_the_emitter_buffers_until_an_absent_coordinator_appears(real_handle, rig_factory)


def test_the_emitters_stores_and_delete_land_in_the_real_directory(
    real: RealCoordinatorHandle, rig_factory: Any
) -> None:
    """Over gRPC: two stores and a delete leave one placement, tokens included."""
    rig = rig_factory(real.target)  # instance node-a, incarnation 3
    rig.emitter.start()
    kept, gone = key(1), key(2)
    rig.emitter.record(
        EventType.STORE, Tier.L2, "fs", False, [CacheEventEntry(kept, 100, (1, 2, 3, 4), 0)]
    )
    rig.emitter.record(
        EventType.STORE, Tier.L2, "fs", False, [CacheEventEntry(gone, 100, (5, 6, 7, 8), 256)]
    )
    rig.emitter.record(EventType.DELETE, Tier.L2, "fs", False, [CacheEventEntry(gone)])
    rig.drain()
    clients = Clients.connect(real.target)
    try:
        first, second = clients.lookup(
            key_to_proto(kept), key_to_proto(gone), include_token_ids=True
        ).results
        assert list(first.placements) == [
            common_pb2.Placement(
                instance_id="node-a",
                incarnation=3,
                tier=common_pb2.TIER_L2,
                backend="fs",
                size_bytes=100,
            )
        ]
        assert (list(first.token_ids), first.num_tokens) == ([1, 2, 3, 4], 4)
        assert (list(second.placements), list(second.token_ids)) == ([], [])
        stats = clients.stats()
        assert (stats.num_keys, stats.num_placements, stats.token_bindings) == (1, 1, 1)
    finally:
        clients.close()
