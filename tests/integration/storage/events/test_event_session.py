"""GrpcEventTransport / GrpcEventSession against a real gRPC server, without the emitter.

These pin the session contract of src/kvmesh/storage/events/transport.py: acks
in stream order on the reader thread, commands on a separate thread (one that
exists only while commands wait) with their results written up the stream,
``on_closed`` exactly once for a stream that ends by itself and never for one
the owner closed, TransportError for an absent coordinator, and no thread
outliving its session.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.events import CacheEventEntry, IngestResult, Tier
from kvmesh.storage.core.ports import QuotaChangedCommand
from kvmesh.storage.events.grpc_transport import GrpcEventTransport
from kvmesh.storage.events.transport import TransportError
from tests.integration.storage.events.support import (
    RecordingListener,
    key,
    store_batch,
)
from tests.support.fake_coordinator import CoordinatorHandle
from tests.support.ports import free_port
from tests.support.waiting import wait_until

NODE = "node-a"


def command_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == f"event-stream-commands-{NODE}"]


@pytest.fixture
def transport(coordinator: CoordinatorHandle) -> Iterator[GrpcEventTransport]:
    link = GrpcEventTransport(coordinator.target, connect_timeout_s=2.0)
    try:
        yield link
    finally:
        link.close()


def test_batches_are_acked_in_order_on_the_reader_thread(
    coordinator: CoordinatorHandle, transport: GrpcEventTransport
) -> None:
    listener = RecordingListener()
    session = transport.connect(NODE, 1, listener)
    for seq in range(1, 21):
        session.send(store_batch(seq))
    listener.wait(lambda: len(listener.acks) == 20)
    assert listener.acks == [(seq, IngestResult.ADMITTED) for seq in range(1, 21)]
    assert listener.threads == {f"ack:event-stream-reader-{NODE}"}
    assert [b.seq for b in coordinator.state.admitted(NODE)] == list(range(1, 21))
    # The coordinator received exactly what was sent, token ids and offset included.
    assert coordinator.state.admitted(NODE)[0] == store_batch(1)
    session.close()
    assert listener.closed == []


def test_the_stream_opens_with_the_emitters_identity_before_any_batch(
    coordinator: CoordinatorHandle, transport: GrpcEventTransport
) -> None:
    session = transport.connect(NODE, 42, RecordingListener())
    # The coordinator can route commands to the node before its first batch.
    coordinator.state.wait_for(lambda: coordinator.state.connected(NODE))
    session.close()
    coordinator.state.wait_for(lambda: not coordinator.state.connected(NODE))


def test_acks_for_another_incarnation_are_ignored(
    coordinator: CoordinatorHandle, transport: GrpcEventTransport
) -> None:
    listener = RecordingListener()
    session = transport.connect(NODE, 5, listener)
    coordinator.state.wait_for(lambda: coordinator.state.connected(NODE))
    stale = ingest_pb2.BatchAck(
        incarnation=4, seq=1, result=events_pb2.INGEST_RESULT_STALE_INCARNATION
    )
    coordinator.state.push_response(NODE, ingest_pb2.StreamEventsResponse(ack=stale))
    session.send(store_batch(1, incarnation=5))
    listener.wait(lambda: len(listener.acks) >= 1)
    assert listener.acks == [(1, IngestResult.ADMITTED)]
    session.close()


def test_commands_run_off_the_reader_thread_and_results_go_up_the_stream(
    coordinator: CoordinatorHandle, transport: GrpcEventTransport
) -> None:
    listener = RecordingListener()
    session = transport.connect(NODE, 1, listener)
    coordinator.state.wait_for(lambda: coordinator.state.connected(NODE))
    # An idle session runs no command thread; one starts when a command arrives.
    assert command_threads() == []
    command = ingest_pb2.NodeCommand(
        command_id="q-1",
        set_quota=ingest_pb2.SetQuotaCommand(
            cache_salt="tenant", tier=common_pb2.TIER_L2, limit_bytes=1 << 30
        ),
    )
    coordinator.state.push_command(NODE, command)
    result = coordinator.state.command_result("q-1")
    assert (result.code, result.affected) == ("OK", 1)
    assert listener.commands == [QuotaChangedCommand("q-1", "tenant", Tier.L2, 1 << 30)]
    assert listener.threads == {f"command:event-stream-commands-{NODE}"}
    wait_until(lambda: command_threads() == [])  # and ends once the queue is empty
    session.close()


def test_a_command_the_node_cannot_express_is_answered_without_running_it(
    coordinator: CoordinatorHandle, transport: GrpcEventTransport
) -> None:
    listener = RecordingListener()
    session = transport.connect(NODE, 1, listener)
    coordinator.state.wait_for(lambda: coordinator.state.connected(NODE))
    coordinator.state.push_command(
        NODE,
        ingest_pb2.NodeCommand(
            command_id="bad-tier",
            delete_keys=ingest_pb2.DeleteKeysCommand(tier=common_pb2.TIER_UNSPECIFIED),
        ),
    )
    coordinator.state.push_command(NODE, ingest_pb2.NodeCommand(command_id="from-the-future"))
    bad = coordinator.state.command_result("bad-tier")
    future = coordinator.state.command_result("from-the-future")
    assert bad.code == "INVALID_ARGUMENT"
    assert "delete_keys.tier" in bad.message
    assert future.code == "UNIMPLEMENTED"
    assert listener.commands == []
    session.close()


def test_a_stream_ended_by_the_coordinator_reports_closed_once_and_stops_its_threads(
    coordinator: CoordinatorHandle,
    transport: GrpcEventTransport,
    no_new_threads: Callable[[], None],
) -> None:
    listener = RecordingListener()
    session = transport.connect(NODE, 1, listener)
    session.send(store_batch(1))
    listener.wait(lambda: len(listener.acks) == 1)
    coordinator.state.break_stream(NODE, grpc.StatusCode.UNAVAILABLE, "going away")
    listener.wait(lambda: len(listener.closed) >= 1)
    assert session.join(5.0)
    assert len(listener.closed) == 1
    error = listener.closed[0]
    assert isinstance(error, TransportError)
    assert "UNAVAILABLE" in str(error)
    with pytest.raises(TransportError):
        session.send(store_batch(2))
    session.close()  # after the end: still harmless, still no second on_closed
    assert len(listener.closed) == 1
    transport.close()
    no_new_threads()


def test_a_batch_the_coordinator_rejects_ends_the_stream_with_its_code(
    coordinator: CoordinatorHandle, transport: GrpcEventTransport
) -> None:
    listener = RecordingListener()
    session = transport.connect(NODE, 1, listener)
    session.send(store_batch(0))  # seq 0 breaks invariant 6
    listener.wait(lambda: len(listener.closed) == 1)
    assert "INVALID_ARGUMENT" in str(listener.closed[0])
    assert coordinator.state.admitted(NODE) == []
    session.close()


def test_token_ids_that_do_not_fit_uint32_are_dropped_not_wedged(
    coordinator: CoordinatorHandle, transport: GrpcEventTransport
) -> None:
    listener = RecordingListener()
    session = transport.connect(NODE, 1, listener)
    bad = replace(store_batch(1), entries=(CacheEventEntry(key(1), 10, (1, 1 << 32), 5),))
    session.send(bad)
    listener.wait(lambda: len(listener.acks) == 1)
    (admitted,) = coordinator.state.admitted(NODE)
    assert admitted.entries == (CacheEventEntry(key(1), 10, (), 5),)
    session.close()


@pytest.mark.parametrize("coordinator_holds", [False, True], ids=["ends", "holds"])
def test_closing_a_session_never_reports_closed_and_leaves_no_thread(
    coordinator: CoordinatorHandle, no_new_threads: Callable[[], None], coordinator_holds: bool
) -> None:
    # Whether or not the coordinator ends its side when the node half-closes.
    coordinator.state.hold_half_closed_streams = coordinator_holds
    transport = GrpcEventTransport(coordinator.target)
    listener = RecordingListener()
    session = transport.connect(NODE, 1, listener)
    session.send(store_batch(1))
    listener.wait(lambda: len(listener.acks) == 1)
    session.close()
    session.close()
    assert session.join(5.0)
    with pytest.raises(TransportError):
        session.send(store_batch(2))
    coordinator.state.wait_for(lambda: not coordinator.state.connected(NODE))
    assert listener.closed == []
    transport.close()
    no_new_threads()


def test_closing_the_transport_closes_its_open_sessions(
    coordinator: CoordinatorHandle, no_new_threads: Callable[[], None]
) -> None:
    coordinator.state.hold_half_closed_streams = True
    transport = GrpcEventTransport(coordinator.target)
    listeners = [RecordingListener() for _ in range(2)]
    sessions = [transport.connect(f"node-{i}", 1, lst) for i, lst in enumerate(listeners)]
    coordinator.state.wait_for(
        lambda: all(coordinator.state.connected(f"node-{i}") for i in range(2))
    )
    transport.close()
    assert all(s.closed and s.join(0) for s in sessions)
    assert [lst.closed for lst in listeners] == [[], []]
    no_new_threads()


def test_connect_to_an_absent_coordinator_raises_transport_error(
    no_new_threads: Callable[[], None],
) -> None:
    """A connection failure raises (LMCache: CacheEventPublishError)."""
    transport = GrpcEventTransport(f"127.0.0.1:{free_port()}", connect_timeout_s=0.3)
    for _ in range(3):
        with pytest.raises(TransportError, match="not reachable"):
            transport.connect(NODE, 1, RecordingListener())
    transport.close()
    with pytest.raises(TransportError, match="closed"):
        transport.connect(NODE, 1, RecordingListener())
    no_new_threads()
