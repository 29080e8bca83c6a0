"""CacheEventEmitter + GrpcEventTransport against a real gRPC coordinator.

At-least-once delivery with the gate's dedup must come out as exactly once,
in order, through stream aborts, a coordinator restart on the same port and a
coordinator that is not there yet; coordinator commands travel down the same
stream and their results (and effects, as cache events) come back up.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.convert import key_to_proto
from kvmesh.common.errors import NotFound
from kvmesh.common.events import CacheEventEntry, EventType, Tier
from kvmesh.storage.core.ports import DeleteKeysCommand, QuotaChangedCommand
from kvmesh.storage.events.config import EmitterConfig
from kvmesh.storage.events.emitter import CacheEventEmitter
from kvmesh.storage.events.grpc_transport import GrpcEventTransport
from tests.integration.storage.events.support import FakeNode, key, key_id
from tests.support.fake_coordinator import CoordinatorHandle, FakeCoordinator
from tests.support.waiting import wait_until

NODE = "node-a"


def _config(**changes: object) -> EmitterConfig:
    settings: dict[str, object] = {
        "instance_id": NODE,
        "incarnation": 3,
        "flush_interval_s": 0.005,
        "max_entries_per_batch": 8,
        "ack_timeout_s": 5.0,
        "reconnect_base_s": 0.02,
        "reconnect_max_s": 0.2,
    }
    settings.update(changes)
    return EmitterConfig(**settings)  # type: ignore[arg-type]


class Rig:
    """An emitter with a node behind it, streaming to ``target`` over gRPC."""

    def __init__(self, target: str, **config: object) -> None:
        self.transport = GrpcEventTransport(target, connect_timeout_s=0.5)
        self.node = FakeNode()
        self.emitter = CacheEventEmitter(
            _config(**config), self.transport, command_handler=self.node, rng=random.Random(7)
        )
        self.node.emitter = self.emitter
        self.recorded: list[tuple[EventType, int]] = []

    def record(self, event_type: EventType, ids: range, tier: Tier = Tier.L1) -> None:
        backend = "dram" if tier is Tier.L1 else "fs"
        self.emitter.record(
            event_type,
            tier,
            backend,
            False,
            [CacheEventEntry(key(i), 4096, (i, i + 1), i) for i in ids],
        )
        self.recorded.extend((event_type, i) for i in ids)

    def drain(self) -> None:
        """Flush what was recorded and wait until the coordinator acked all of it."""
        self.emitter.flush()
        assert self.emitter.wait_until_drained(10.0)

    def close(self) -> None:
        self.emitter.close(timeout=5.0)
        self.transport.close()


@pytest.fixture
def rig_factory() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(target: str, **config: object) -> Rig:
        rig = Rig(target, **config)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def _assert_exactly_once_in_order(state: FakeCoordinator, rig: Rig) -> None:
    batches = state.admitted(NODE)
    assert [b.seq for b in batches] == list(range(1, rig.emitter.last_seq + 1))
    got = [(b.event_type, key_id(e.key)) for b in batches for e in b.entries]
    assert got == rig.recorded
    cursor = state.cursor(NODE)
    assert cursor is not None
    assert not cursor.gap_detected
    assert cursor.incarnation == rig.emitter.config.incarnation


def test_every_batch_reaches_the_coordinator_exactly_once_in_order(
    coordinator: CoordinatorHandle,
    rig_factory: Callable[..., Rig],
    no_new_threads: Callable[[], None],
) -> None:
    """Real threads deliver every batch in order; close flushes the tail."""
    rig = rig_factory(coordinator.target)
    rig.emitter.start()
    for start in range(0, 300, 30):
        rig.record(EventType.STORE, range(start, start + 25))
        rig.record(EventType.ACCESS, range(start, start + 3))
        rig.record(EventType.DELETE, range(start + 25, start + 27), Tier.L2)
    assert rig.emitter.close(timeout=10.0)
    _assert_exactly_once_in_order(coordinator.state, rig)
    stats = rig.emitter.stats()
    assert stats.acks_admitted == stats.last_seq > 30
    assert stats.acks_duplicate == 0
    assert stats.sessions_opened == 1
    rig.transport.close()
    no_new_threads()


@pytest.mark.parametrize("ingest_last", [True, False], ids=["ack-lost", "batch-lost"])
def test_an_aborted_stream_is_reopened_and_unacked_batches_resent(
    coordinator: CoordinatorHandle, rig_factory: Callable[..., Rig], ingest_last: bool
) -> None:
    state = coordinator.state
    rig = rig_factory(coordinator.target)
    rig.emitter.start()
    rig.record(EventType.STORE, range(16))
    rig.drain()
    state.abort_stream_after(3, ingest_last=ingest_last)
    for start in range(16, 96, 8):
        rig.record(EventType.STORE, range(start, start + 8))
    rig.drain()
    state.abort_stream_after(1, ingest_last=ingest_last, code=grpc.StatusCode.INTERNAL)
    rig.record(EventType.DELETE, range(8))
    assert rig.emitter.close(timeout=10.0)
    _assert_exactly_once_in_order(state, rig)
    stats = rig.emitter.stats()
    assert stats.sessions_opened >= 3
    assert stats.disconnects >= 2
    if ingest_last:
        # The batch whose ack was lost came back as a duplicate, and was dropped.
        assert state.duplicates(NODE) >= 1


def test_a_coordinator_restart_on_the_same_port_loses_nothing(
    coordinator: CoordinatorHandle, rig_factory: Callable[..., Rig]
) -> None:
    rig = rig_factory(coordinator.target)
    rig.emitter.start()
    rig.record(EventType.STORE, range(40))
    rig.drain()
    coordinator.stop()  # state survives, as from a checkpoint
    rig.record(EventType.STORE, range(40, 80))
    rig.emitter.flush()
    assert rig.emitter.stats().window_depth > 0  # nobody to ack them
    coordinator.start()
    assert rig.emitter.close(timeout=10.0)
    _assert_exactly_once_in_order(coordinator.state, rig)
    assert rig.emitter.stats().sessions_opened >= 2


def test_the_emitter_buffers_until_an_absent_coordinator_appears(
    coordinator_handle: CoordinatorHandle, rig_factory: Callable[..., Rig]
) -> None:
    rig = rig_factory(coordinator_handle.target)
    rig.emitter.start()
    rig.record(EventType.STORE, range(50))
    rig.emitter.flush()
    # Connects fail promptly (TransportError), and the sender keeps retrying.
    wait_until(lambda: rig.emitter.stats().connect_failures >= 2)
    stats = rig.emitter.stats()
    assert stats.connect_failures >= 2
    assert "not reachable" in stats.last_error
    assert stats.window_depth == rig.emitter.last_seq
    coordinator_handle.start()
    rig.record(EventType.ACCESS, range(5))
    assert rig.emitter.close(timeout=10.0)
    _assert_exactly_once_in_order(coordinator_handle.state, rig)


def test_a_delete_command_runs_on_the_node_and_its_effects_come_back_as_events(
    coordinator: CoordinatorHandle, rig_factory: Callable[..., Rig]
) -> None:
    state = coordinator.state
    rig = rig_factory(coordinator.target)
    rig.node.l2 = {key(i): 100 for i in range(10)}
    rig.emitter.start()
    rig.record(EventType.STORE, range(10), Tier.L2)
    rig.drain()
    state.wait_for(lambda: state.connected(NODE))
    wanted = [key(2), key(3), key(99)]  # 99 is not on the node: not an error
    state.push_command(
        NODE,
        ingest_pb2.NodeCommand(
            command_id="evict-1",
            delete_keys=ingest_pb2.DeleteKeysCommand(
                tier=common_pb2.TIER_L2,
                backend="fs",
                keys=[key_to_proto(k) for k in wanted],
                force=True,
            ),
        ),
    )
    result = state.command_result("evict-1")
    assert (result.command_id, result.code, result.message) == ("evict-1", "OK", "")
    assert result.affected == 2
    assert rig.node.handled == [DeleteKeysCommand("evict-1", Tier.L2, "fs", tuple(wanted), True)]
    # The effects are in the stream at or below effects_through_seq.
    state.wait_for(
        lambda: (c := state.cursor(NODE)) is not None and c.last_seq >= result.effects_through_seq
    )
    deletes = [
        b
        for b in state.admitted(NODE)
        if b.event_type is EventType.DELETE and b.seq <= result.effects_through_seq
    ]
    assert [key_id(e.key) for b in deletes for e in b.entries] == [2, 3]
    assert set(rig.node.l2) == {key(i) for i in range(10) if i not in (2, 3)}


def test_a_failing_command_reports_its_status_code(
    coordinator: CoordinatorHandle, rig_factory: Callable[..., Rig]
) -> None:
    state = coordinator.state
    rig = rig_factory(coordinator.target)
    rig.emitter.start()
    state.wait_for(lambda: state.connected(NODE))
    rig.node.fail_with = NotFound("no such backend: nvme")
    state.push_command(
        NODE,
        ingest_pb2.NodeCommand(
            command_id="evict-2",
            delete_keys=ingest_pb2.DeleteKeysCommand(
                tier=common_pb2.TIER_L2, backend="nvme", keys=[key_to_proto(key(1))]
            ),
        ),
    )
    result = state.command_result("evict-2")
    assert (result.code, result.message, result.affected) == (
        "NOT_FOUND",
        "no such backend: nvme",
        0,
    )
    # A zero-byte quota is a real quota; an absent limit removes the quota (None).
    rig.node.fail_with = None
    state.push_command(
        NODE,
        ingest_pb2.NodeCommand(
            command_id="quota-0",
            set_quota=ingest_pb2.SetQuotaCommand(
                cache_salt="t", tier=common_pb2.TIER_L2, limit_bytes=0
            ),
        ),
    )
    state.push_command(
        NODE,
        ingest_pb2.NodeCommand(
            command_id="quota-off",
            set_quota=ingest_pb2.SetQuotaCommand(cache_salt="t", tier=common_pb2.TIER_L2),
        ),
    )
    assert state.command_result("quota-0").code == "OK"
    assert state.command_result("quota-off").code == "OK"
    assert rig.node.handled[1:] == [
        QuotaChangedCommand("quota-0", "t", Tier.L2, 0),
        QuotaChangedCommand("quota-off", "t", Tier.L2, None),
    ]
    stats = rig.emitter.stats()
    assert (stats.commands_handled, stats.commands_failed) == (3, 1)
