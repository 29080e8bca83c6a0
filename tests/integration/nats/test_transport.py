"""The storage side: :class:`NatsEventTransport` under the real emitter and a real nats-server.

* An unreachable server fails ``connect`` promptly with TransportError.
* A batch sent again on a new session is acked DUPLICATE by JetStream's
  ``Nats-Msg-Id`` window and stored once; acks leave in seq order.
* Across a NATS restart the emitter reconnects and resends: the stream ends
  up with every seq, in order, each once.
* A command published to the node reaches its handler; the result comes back.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.events import (
    CacheEventBatch,
    CacheEventEntry,
    EventType,
    IngestResult,
    Tier,
)
from kvmesh.common.keys import ObjectKey
from kvmesh.common.nats_names import command_results_subject, commands_subject
from kvmesh.storage.core.ports import DeleteKeysCommand, NodeCommand
from kvmesh.storage.events.config import EmitterConfig
from kvmesh.storage.events.emitter import CacheEventEmitter
from kvmesh.storage.events.nats_transport import NatsEventTransport
from kvmesh.storage.events.transport import CommandResult, TransportError
from tests.integration.coordinator.support import pkey
from tests.integration.nats.conftest import Fleet
from tests.integration.nats.support import RawNats, batch_seqs, wait_true
from tests.support.ports import free_port
from tests.support.servers import ServerProcess, ServerStartError


class Recorder:
    """A SessionListener that records what the session reports."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acks: list[tuple[int, IngestResult]] = []
        self.commands: list[NodeCommand] = []
        self.closed: list[BaseException | None] = []

    def on_ack(self, seq: int, result: IngestResult) -> None:
        with self.lock:
            self.acks.append((seq, result))

    def on_command(self, command: NodeCommand) -> CommandResult:
        with self.lock:
            self.commands.append(command)
        return CommandResult(command_id=command.command_id, affected=7, effects_through_seq=3)

    def on_closed(self, error: BaseException | None) -> None:
        with self.lock:
            self.closed.append(error)


def core_batch(instance_id: str, seq: int, n: int = 2) -> CacheEventBatch:
    """A STORE batch of ``n`` L1 keys."""
    return CacheEventBatch(
        instance_id=instance_id,
        incarnation=1,
        seq=seq,
        event_type=EventType.STORE,
        tier=Tier.L1,
        backend="dram",
        entries=tuple(
            CacheEventEntry(ObjectKey(uuid.uuid4().bytes * 2, "m/x", 0, 0, ""), 10)
            for _ in range(n)
        ),
        ts=1.0,
    )


@pytest.fixture
def transport(nats: ServerProcess) -> Iterator[NatsEventTransport]:
    # A generous connect deadline: these tests are about acks and sessions, and a loaded
    # 2-core CI host once took over 1 s to finish a connect to the local nats-server.
    t = NatsEventTransport(nats.url, connect_timeout_s=10.0, ack_timeout_s=2.0)
    try:
        yield t
    finally:
        t.close()


def test_connect_to_an_absent_server_fails_promptly() -> None:
    transport = NatsEventTransport(f"nats://127.0.0.1:{free_port()}", connect_timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(TransportError):
            transport.connect("absent", 1, Recorder())
        assert time.monotonic() - started < 3.0
    finally:
        transport.close()
    with pytest.raises(TransportError):
        transport.connect("absent", 1, Recorder())  # closed for good


def test_a_resent_batch_is_acked_duplicate_and_stored_once(
    fleet: Fleet, transport: NatsEventTransport
) -> None:
    first, second = core_batch("tx-a", 1), core_batch("tx-a", 2)
    recorder = Recorder()
    session = transport.connect("tx-a", 1, recorder)
    session.send(first)
    session.send(second)
    wait_true(lambda: len(recorder.acks) == 2)
    assert recorder.acks == [(1, IngestResult.ADMITTED), (2, IngestResult.ADMITTED)]
    session.close()
    assert session.closed

    again = Recorder()
    session = transport.connect("tx-a", 1, again)
    session.send(first)  # its PubAck was "lost": the emitter resends on a new session
    session.send(core_batch("tx-a", 3))
    wait_true(lambda: len(again.acks) == 2)
    assert again.acks == [(1, IngestResult.DUPLICATE), (3, IngestResult.ADMITTED)]
    session.close()
    assert recorder.closed == again.closed == []  # closed by its owner: no on_closed

    raw = RawNats(fleet.thread, fleet.nats_url)
    try:
        assert batch_seqs(raw.stream_messages(), "tx-a") == [1, 2, 3]
    finally:
        raw.close()


def restart(server: ServerProcess) -> None:
    """Start ``server`` again on its port and store.

    Retried: the fixture's child is forked with a preexec hook while this
    process runs gRPC threads, and such a child occasionally aborts before
    exec (the first start of a fixture server retries for the same reason).
    """
    for attempt in range(3):
        try:
            server.start()
            return
        except ServerStartError:
            if attempt == 2:
                raise


def test_the_emitter_resends_across_a_nats_restart_and_a_hang(
    fleet: Fleet, nats: ServerProcess
) -> None:
    transport = NatsEventTransport(nats.url, connect_timeout_s=0.5, ack_timeout_s=0.5)
    emitter = CacheEventEmitter(
        EmitterConfig(
            instance_id="tx-restart",
            incarnation=1,
            flush_interval_s=0.002,
            reconnect_base_s=0.02,
            reconnect_max_s=0.2,
        ),
        transport,
    )
    emitter.start()

    def record(n: int) -> None:
        for _ in range(n):
            key = ObjectKey(uuid.uuid4().bytes * 2, "m/x", 0, 0, "")
            emitter.record(EventType.STORE, Tier.L1, "dram", False, [CacheEventEntry(key, 1)])
            time.sleep(0.001)  # several batches, not one

    try:
        record(20)
        assert emitter.wait_until_drained(10.0)
        # A restart: the connection drops, the session ends at once.
        nats.stop()
        record(20)  # recorded while the server is down: waits in the window
        wait_true(lambda: not emitter.stats().connected)
        assert emitter.stats().window_depth > 0
        restart(nats)
        record(20)
        assert emitter.wait_until_drained(15.0)
        reconnects = emitter.stats().reconnects
        assert reconnects >= 1
        # A hang: the connection stays up but no PubAck comes; the ack watchdog ends it.
        nats.pause()
        try:
            record(20)
            wait_true(lambda: emitter.stats().disconnects >= 2)
            assert emitter.stats().window_depth > 0
        finally:
            nats.resume()
        record(20)
        assert emitter.wait_until_drained(15.0)
        stats = emitter.stats()
        assert stats.reconnects > reconnects
        assert stats.batches_dropped == 0
    finally:
        drained = emitter.close(timeout=5.0)
        transport.close()
    assert drained
    last_seq = emitter.last_seq  # close flushed whatever was still pending
    raw = RawNats(fleet.thread, fleet.nats_url)
    try:
        seqs = batch_seqs(raw.stream_messages(), "tx-restart")
    finally:
        raw.close()
    # Resends the server had stored already were dropped by the Nats-Msg-Id window.
    assert seqs == list(range(1, last_seq + 1))


def test_a_command_reaches_the_listener_and_its_result_comes_back(
    fleet: Fleet, transport: NatsEventTransport
) -> None:
    recorder = Recorder()
    session = transport.connect("tx.cmd node", 1, recorder)  # '.' and ' ' need escaping
    raw = RawNats(fleet.thread, fleet.nats_url)
    results: list[ingest_pb2.CommandResult] = []

    async def listen() -> None:
        async def on_result(msg: Any) -> None:
            results.append(ingest_pb2.CommandResult.FromString(msg.data))

        await raw.nc.subscribe(command_results_subject("tx.cmd node"), cb=on_result)
        await raw.nc.flush()

    try:
        fleet.thread.run(listen())
        command = ingest_pb2.NodeCommand(
            command_id="c-1",
            delete_keys=ingest_pb2.DeleteKeysCommand(
                tier=common_pb2.TIER_L2, backend="disk", keys=[pkey(4)]
            ),
        )
        raw.core_publish(commands_subject("tx.cmd node"), command.SerializeToString())
        # A command the node cannot parse is answered too (INVALID_ARGUMENT), not run.
        bad = ingest_pb2.NodeCommand(
            command_id="c-2",
            delete_keys=ingest_pb2.DeleteKeysCommand(tier=common_pb2.TIER_UNSPECIFIED),
        )
        raw.core_publish(commands_subject("tx.cmd node"), bad.SerializeToString())
        wait_true(lambda: len(results) == 2)
    finally:
        raw.close()
        session.close()
    [received] = recorder.commands
    assert isinstance(received, DeleteKeysCommand)
    assert (received.command_id, received.tier, received.backend) == ("c-1", Tier.L2, "disk")
    assert received.keys[0].chunk_hash == pkey(4).chunk_hash
    assert [(r.command_id, r.code, r.affected, r.effects_through_seq) for r in results] == [
        ("c-1", "OK", 7, 3),
        ("c-2", "INVALID_ARGUMENT", 0, 0),
    ]
