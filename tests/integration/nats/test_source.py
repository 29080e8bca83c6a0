"""The coordinator's NATS source against what a raw publisher puts in the stream.

* A batch published twice with one ``Nats-Msg-Id`` is stored once (JetStream
  dedup); a batch stored twice (a replay, or a resend after the duplicate
  window) is admitted once (the gate's seq dedup).
* Undecodable, invalid and misaddressed messages are skipped, the position
  moves past them and the stream goes on.
* A batch first seen at ``seq > 1`` from an emitter the gate does not know
  (its beginning expired) makes the source ask that node to resync.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.events import CacheEventBatch, IngestResult
from kvmesh.common.nats_names import (
    DEFAULT_STREAM,
    commands_subject,
    events_subject,
    message_id,
)
from kvmesh.coordinator.sources.jetstream import NatsEventSource
from kvmesh.storage.events.jetstream import StreamSettings, ensure_stream
from tests.integration.coordinator.support import L2, Coord, batch, pkey, stores
from tests.integration.nats.conftest import Fleet
from tests.integration.nats.support import RawNats, wait_true
from tests.integration.nats.test_transport import restart
from tests.support.servers import ServerProcess


@pytest.fixture
def raw(fleet: Fleet) -> Iterator[RawNats]:
    """A raw NATS client of this test's server, with the event stream created."""
    client = RawNats(fleet.thread, fleet.nats_url)
    fleet.thread.run(ensure_stream(client.nc.jetstream(), StreamSettings()))
    try:
        yield client
    finally:
        client.close()


def source_of(coord: Coord) -> NatsEventSource:
    source = coord.app.nats
    assert source is not None
    return source


def wait_applied_through(source: NatsEventSource, stream_seq: int) -> None:
    """Wait until the source moved past ``stream_seq``."""
    wait_true(lambda: source.position.next_seq > stream_seq)


def test_a_resent_batch_is_stored_once_and_a_replayed_one_admitted_once(
    fleet: Fleet, raw: RawNats
) -> None:
    """A replayed message is absorbed by the gate's seq dedup."""
    coord = fleet.coordinator()
    source = source_of(coord)
    subject = events_subject("raw-a")
    first = batch("raw-a", 1, tier=L2, entries=stores([1, 2])).SerializeToString()
    stored = raw.publish(subject, first, msg_id=message_id("raw-a", 1, 1))
    resent = raw.publish(subject, first, msg_id=message_id("raw-a", 1, 1))
    assert resent == {"stream": DEFAULT_STREAM, "seq": stored["seq"], "duplicate": True}
    # The same batch again under another id: JetStream stores it, the gate drops it.
    replayed = raw.publish(subject, first, msg_id="raw-a/1/1/replayed")
    assert replayed["seq"] == stored["seq"] + 1
    second = batch("raw-a", 2, tier=L2, entries=stores([3])).SerializeToString()
    last = raw.publish(subject, second, msg_id=message_id("raw-a", 1, 2))
    wait_applied_through(source, last["seq"])

    stats = source.stats()
    assert (stats.applied, stats.admitted, stats.duplicate, stats.skipped) == (3, 2, 1, 0)
    assert stats.pending == 0
    c = coord.clients
    cursor = c.cursors()["raw-a"]
    assert (cursor.last_seq, cursor.gap_detected) == (2, False)
    assert (cursor.batches_admitted, cursor.batches_duplicate) == (2, 1)
    for i in (1, 2, 3):
        assert c.placements(pkey(i)) == [("raw-a", 1, L2, "disk", 100)]
    assert c.usage().salts[0].used_bytes == 300


def test_undecodable_and_invalid_messages_are_skipped_and_the_stream_goes_on(
    fleet: Fleet, raw: RawNats
) -> None:
    """Undecodable or invalid messages are skipped; the position still moves."""
    coord = fleet.coordinator()
    source = source_of(coord)
    raw.publish("kvmesh.events.junk", b"\xff\xff\xff\xff not a protobuf")
    # Decodes, but seq 0 is invalid.
    raw.publish(events_subject("raw-b"), batch("raw-b", 0, entries=stores([5])).SerializeToString())
    # Valid, but published under another instance's subject.
    raw.publish(events_subject("raw-b"), batch("raw-c", 1, entries=stores([6])).SerializeToString())
    good = raw.publish(
        events_subject("raw-b"), batch("raw-b", 1, entries=stores([7])).SerializeToString()
    )
    wait_applied_through(source, good["seq"])
    stats = source.stats()
    assert (stats.skipped, stats.applied, stats.admitted) == (3, 1, 1)
    assert source.position.next_seq == good["seq"] + 1
    c = coord.clients
    assert set(c.cursors()) == {"raw-b"}
    assert c.placements(pkey(7))[0][0] == "raw-b"
    assert c.placements(pkey(5)) == c.placements(pkey(6)) == []

    # The stream still moves after the bad messages.
    more = raw.publish(
        events_subject("raw-b"), batch("raw-b", 2, entries=stores([8])).SerializeToString()
    )
    wait_applied_through(source, more["seq"])
    assert c.cursors()["raw-b"].last_seq == 2


def test_an_emitter_first_seen_past_its_start_is_asked_to_resync(
    fleet: Fleet, raw: RawNats
) -> None:
    coord = fleet.coordinator()
    source = source_of(coord)
    commands: list[ingest_pb2.NodeCommand] = []

    async def subscribe() -> None:
        async def on_command(msg: object) -> None:
            commands.append(ingest_pb2.NodeCommand.FromString(msg.data))  # type: ignore[attr-defined]

        await raw.nc.subscribe(commands_subject("raw.d"), cb=on_command)
        await raw.nc.flush()

    fleet.thread.run(subscribe())
    # Seq 40 of an emitter the coordinator never heard of: seqs 1..39 are gone.
    late = raw.publish(
        events_subject("raw.d"),
        batch("raw.d", 40, tier=L2, entries=stores([9])).SerializeToString(),
    )
    wait_applied_through(source, late["seq"])
    wait_true(lambda: len(commands) == 2)
    assert sorted(cmd.resync.tier for cmd in commands) == [1, 2]  # L1 and L2
    assert all(cmd.command_id for cmd in commands)
    cursor = coord.clients.cursors()["raw.d"]
    assert (cursor.last_seq, cursor.gap_detected) == (40, True)
    assert source.stats().resyncs_requested == 2


def test_a_batch_whose_ingest_raises_is_logged_and_skipped_and_the_stream_goes_on(
    fleet: Fleet,
    raw: RawNats,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A record whose consumer raises is skipped, its offset recorded (as LMCache's Kafka)."""
    caplog.set_level(logging.ERROR, logger="kvmesh.coordinator.sources")
    coord = fleet.coordinator()
    source = source_of(coord)
    real_ingest = source._applier._ingest

    def flaky(b: CacheEventBatch) -> IngestResult:
        if b.seq == 2:
            raise RuntimeError("injected")
        return real_ingest(b)

    monkeypatch.setattr(source._applier, "_ingest", flaky)
    subject = events_subject("raw-e")
    for seq in (1, 2):
        raw.publish(
            subject, batch("raw-e", seq, tier=L2, entries=stores([seq])).SerializeToString()
        )
    last = raw.publish(subject, batch("raw-e", 3, tier=L2, entries=stores([3])).SerializeToString())
    wait_applied_through(source, last["seq"])

    stats = source.stats()
    assert (stats.applied, stats.admitted, stats.skipped) == (2, 2, 1)
    assert source.position.next_seq == last["seq"] + 1
    c = coord.clients
    assert [bool(c.placements(pkey(i))) for i in (1, 2, 3)] == [True, False, True]
    cursor = c.cursors()["raw-e"]
    assert (cursor.last_seq, cursor.gap_detected) == (3, True)  # seq 2 never reached the gate
    assert any(
        "ingesting batch" in r.getMessage() and r.exc_info is not None for r in caplog.records
    )


def test_the_source_logs_a_lost_connection_and_reads_on_after_nats_restarts(
    fleet: Fleet, nats: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer error is logged and polling continues (as LMCache's Kafka source)."""
    caplog.set_level(logging.WARNING, logger="kvmesh.coordinator.sources")
    coord = fleet.coordinator()
    source = source_of(coord)
    subject = events_subject("raw-f")
    before = RawNats(fleet.thread, fleet.nats_url)
    try:
        fleet.thread.run(ensure_stream(before.nc.jetstream(), StreamSettings()))
        first = before.publish(
            subject, batch("raw-f", 1, tier=L2, entries=stores([1])).SerializeToString()
        )
        wait_applied_through(source, first["seq"])
    finally:
        before.close()
    sessions = source.stats().sessions

    nats.stop()  # the source's connection breaks; the stream stays on disk
    wait_true(lambda: not source.connected)
    restart(nats)

    after = RawNats(fleet.thread, fleet.nats_url)
    try:
        second = after.publish(
            subject, batch("raw-f", 2, tier=L2, entries=stores([2])).SerializeToString()
        )
        wait_applied_through(source, second["seq"])
    finally:
        after.close()
    stats = source.stats()
    assert stats.sessions > sessions
    assert (stats.applied, stats.admitted, stats.skipped) == (2, 2, 0)
    cursor = coord.clients.cursors()["raw-f"]
    assert (cursor.last_seq, cursor.gap_detected) == (2, False)
    assert coord.clients.placements(pkey(2)) == [("raw-f", 1, L2, "disk", 100)]
    assert any("NATS event source:" in r.getMessage() for r in caplog.records)
