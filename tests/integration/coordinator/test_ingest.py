"""EventIngestService over a real socket: the node stream and the unary form.

The stream opens with ``open``; every batch gets one ack, in order, whose
verdict is the gate's (docs/coordinator.md, "Event gate"): ADMITTED, DUPLICATE for a seq at or
below the cursor, STALE_INCARNATION for an older incarnation; a newer
incarnation fences the emitter's L1 placements first. A second stream of the
same instance replaces the first. ``IngestBatches`` returns one verdict per
batch.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import admin_pb2, ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.events import CacheEventBatch, IngestResult
from tests.integration.coordinator.support import (
    ADMITTED,
    DUPLICATE,
    L1,
    L2,
    STALE,
    Coord,
    batch,
    code_of,
    pkey,
    stores,
)
from tests.support.waiting import wait_until


def test_stream_acks_every_batch_in_order_with_the_gates_verdict(coord: Coord) -> None:
    """Over gRPC: seq 6 after 2 is admitted, flags the gap; its key is present."""
    node = coord.node("node-a", incarnation=5)
    node.batch(1, entries=stores([1]))
    node.batch(2, entries=stores([2]))
    node.batch(2, entries=stores([99]))  # replay of seq 2 with other content
    node.batch(1, entries=stores([98]))  # out of order: dropped forever
    node.batch(3, incarnation=4, entries=stores([97]))  # an older incarnation
    node.batch(6, entries=stores([6]))  # skips 3..5: admitted, gap flagged
    assert node.verdicts(6) == [
        (5, 1, ADMITTED),
        (5, 2, ADMITTED),
        (5, 2, DUPLICATE),
        (5, 1, DUPLICATE),
        (4, 3, STALE),
        (5, 6, ADMITTED),
    ]
    c = coord.clients
    assert [
        bool(r.placements) for r in c.lookup(*(pkey(i) for i in (1, 2, 6, 99, 98, 97))).results
    ] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    cursor = c.cursors()["node-a"]
    assert (cursor.incarnation, cursor.last_seq, cursor.gap_detected) == (5, 6, True)
    assert (cursor.batches_admitted, cursor.batches_duplicate, cursor.batches_stale) == (3, 2, 1)
    node.close()


def test_a_new_incarnation_on_the_stream_fences_l1_and_keeps_l2(coord: Coord) -> None:
    old = coord.node("node-a", incarnation=1)
    old.batch(1, tier=L1, entries=stores([1, 2]))
    old.batch(2, tier=L2, entries=stores([1, 3]))
    old.wait_acks(2)
    old.close()
    new = coord.node("node-a", incarnation=2)
    new.batch(1, tier=L1, entries=stores([4]))
    assert new.verdicts(1) == [(2, 1, ADMITTED)]
    c = coord.clients
    assert c.placements(pkey(1)) == [("node-a", 1, L2, "disk", 100)]
    assert c.placements(pkey(2)) == []
    assert c.placements(pkey(3)) == [("node-a", 1, L2, "disk", 100)]
    assert c.placements(pkey(4)) == [("node-a", 2, L1, "dram", 100)]
    assert c.stats().l1_keys_by_instance["node-a"] == 1
    # The old incarnation is stale from now on, even on a fresh stream.
    late = coord.node("node-a", incarnation=1)
    late.batch(3, tier=L1, entries=stores([5]))
    assert late.verdicts(1) == [(1, 3, STALE)]
    assert c.placements(pkey(5)) == []
    late.close()
    new.close()


def test_a_second_stream_of_the_same_instance_replaces_the_first(coord: Coord) -> None:
    first = coord.node("node-a")
    first.batch(1, entries=stores([1]))
    first.wait_acks(1)
    second = coord.node("node-a")
    error = first.wait_ended()
    # The coordinator ends the old call CANCELLED (not a silent OK end).
    assert error is not None
    assert code_of(error) == grpc.StatusCode.CANCELLED
    assert "replaced" in str(error.details())
    second.batch(2, entries=stores([2]))
    assert second.verdicts(1) == [(1, 2, ADMITTED)]
    status = coord.clients.admin.get_status(admin_pb2.GetStatusRequest())
    assert status.connected_streams == 1
    assert coord.app.streams.connected("node-a")
    second.close()
    wait_until(lambda: not coord.app.streams.connected("node-a"))


def test_an_unknown_emitter_is_asked_to_resync_and_a_known_one_is_not(coord: Coord) -> None:
    node = coord.node("node-a")
    node.wait(lambda: len(node.commands) >= 2)
    kinds = [(c.WhichOneof("kind"), c.resync.tier) for c in node.commands]
    assert kinds == [("resync", L1), ("resync", L2)]
    assert len({c.command_id for c in node.commands}) == 2
    node.batch(1, entries=stores([1]))
    node.wait_acks(1)
    node.close()
    again = coord.node("node-a")
    again.batch(2, entries=stores([2]))
    again.wait_acks(1)
    assert again.commands == []
    again.close()


def test_a_node_that_vanishes_mid_stream_is_forgotten_quietly_and_its_resend_deduplicated(
    coord: Coord, caplog: pytest.LogCaptureFixture
) -> None:
    """The call ends while acks are being written: no error logged, nothing half-applied."""
    caplog.set_level(logging.WARNING)
    n = 300
    node = coord.node("node-a")
    for seq in range(1, n + 1):
        node.batch(seq, entries=stores([seq]))
    node.wait_acks(1)
    node.vanish()
    wait_until(lambda: not coord.app.streams.connected("node-a"))
    applied = coord.clients.cursors()["node-a"].last_seq
    assert 1 <= applied <= n
    again = coord.node("node-a")
    for seq in range(1, n + 1):
        again.batch(seq, entries=stores([seq]))
    results = [r for _inc, _seq, r in again.verdicts(n)]
    assert results == [DUPLICATE] * applied + [ADMITTED] * (n - applied)
    assert coord.clients.stats().num_keys == n
    again.close()
    node.channel.close()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("kvmesh.")] == []


def test_command_results_travel_up_the_stream(coord: Coord) -> None:
    node = coord.node("node-a")
    node.wait(lambda: len(node.commands) >= 1)
    command_id = node.commands[0].command_id
    node.result(command_id, affected=7, effects_through_seq=3)
    node.batch(1, entries=stores([1]))  # acked after the result was read: it is recorded
    node.wait_acks(1)
    recorded = coord.app.streams.command_results[command_id]
    assert (recorded.code, recorded.affected, recorded.effects_through_seq) == ("OK", 7, 3)
    node.close()


def test_ingest_batches_returns_one_verdict_per_batch(coord: Coord) -> None:
    """A mixed request, and a replay: all duplicates, usage counted once."""
    c = coord.clients
    response = c.ingest_batches(
        _b(incarnation=2, seq=1, ids=[1]),
        _b(incarnation=2, seq=1, ids=[2]),
        _b(incarnation=1, seq=9, ids=[3]),
        _b(incarnation=2, seq=2, ids=[4]),
    )
    assert list(response.results) == [ADMITTED, DUPLICATE, STALE, ADMITTED]
    assert (response.admitted, response.duplicates, response.stale) == (2, 1, 1)
    assert [bool(r.placements) for r in c.lookup(*(pkey(i) for i in (1, 2, 3, 4))).results] == [
        True,
        False,
        False,
        True,
    ]
    # A replay of the whole request changes nothing.
    replay = c.ingest_batches(_b(incarnation=2, seq=1, ids=[1]), _b(incarnation=2, seq=2, ids=[4]))
    assert list(replay.results) == [DUPLICATE, DUPLICATE]
    assert c.usage().salts[0].used_bytes == 200
    # An empty request is fine.
    empty = c.ingest.ingest_batches(ingest_pb2.IngestBatchesRequest())
    assert (list(empty.results), empty.admitted) == ([], 0)


def test_ingest_batches_of_a_new_incarnation_fence_l1(coord: Coord) -> None:
    c = coord.clients
    c.ingest_batches(
        _b(incarnation=1, seq=1, ids=[1, 2]), _b(incarnation=1, seq=2, ids=[3], tier=L2)
    )
    response = c.ingest_batches(_b(incarnation=2, seq=1, ids=[4]))
    assert list(response.results) == [ADMITTED]
    assert [len(r.placements) for r in c.lookup(pkey(1), pkey(2), pkey(3), pkey(4)).results] == [
        0,
        0,
        1,
        1,
    ]
    cursor = c.cursors()["node-a"]
    assert (cursor.incarnation, cursor.last_seq, cursor.gap_detected) == (2, 1, False)


def test_one_batch_is_one_admitted_and_its_placement_carries_every_field(coord: Coord) -> None:
    """One batch → (1, 0, 0); Lookup shows every placement field."""
    c = coord.clients
    one = batch(
        "node-a",
        1,
        incarnation=4,
        tier=L2,
        backend="s3",
        shared=True,
        entries=stores([1], size=1024),
    )
    response = c.ingest_batches(one)
    assert list(response.results) == [ADMITTED]
    assert (response.admitted, response.duplicates, response.stale) == (1, 0, 0)
    assert list(c.lookup(pkey(1)).results[0].placements) == [
        common_pb2.Placement(
            instance_id="node-a",
            incarnation=4,
            tier=L2,
            backend="s3",
            size_bytes=1024,
            shared=True,
        )
    ]


def _b(*, incarnation: int, seq: int, ids: list[int], tier: int = L1) -> events_pb2.CacheEventBatch:
    return batch("node-a", seq, incarnation=incarnation, tier=tier, entries=stores(ids))


def test_an_unexpected_failure_ends_the_stream_with_internal(
    coord: Coord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug behind the stream is an INTERNAL error to the node, never a silent OK end."""
    real = coord.app.core.ingest_validated

    def flaky(batch: CacheEventBatch) -> IngestResult:
        if batch.seq == 2:
            raise RuntimeError("injected")
        return real(batch)

    monkeypatch.setattr(coord.app.core, "ingest_validated", flaky)
    node = coord.node("node-a")
    node.batch(1, entries=stores([1]))
    node.batch(2, entries=stores([2]))
    error = node.wait_ended()
    assert error is not None
    assert code_of(error) == grpc.StatusCode.INTERNAL
    assert [a.seq for a in node.acks] == [1]
    node.close()
