"""Every batch invariant broken once over gRPC: INVALID_ARGUMENT naming the field, nothing applied.

Unary ``IngestBatches``: a valid batch followed by the bad one; the whole
request is rejected, so not even the valid batch is applied. Stream: a valid
batch (acked, applied) then the bad one; the stream ends with
INVALID_ARGUMENT, the earlier batch stays applied and the bad one touches
nothing. "Nothing" is checked on everything ingest can change: stats,
cursors (with their counters), every key of the directory and usage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from tests.integration.coordinator.conftest import CoordFactory
from tests.integration.coordinator.support import (
    ACCESS,
    ADMITTED,
    CONFIG,
    DELETE,
    L2,
    STORE,
    Coord,
    RawNode,
    batch,
    code_of,
    entry,
    field_of,
    pkey,
    stores,
)


@dataclass(frozen=True)
class Case:
    """One broken invariant: how to break a valid seq-2 batch, and the field named."""

    name: str
    breaks: Callable[[events_pb2.CacheEventBatch], None]
    field: str


def _set(**fields: Any) -> Callable[[events_pb2.CacheEventBatch], None]:
    def apply(msg: events_pb2.CacheEventBatch) -> None:
        for name, value in fields.items():
            setattr(msg, name, value)

    return apply


def _entry_key(**fields: Any) -> Callable[[events_pb2.CacheEventBatch], None]:
    def apply(msg: events_pb2.CacheEventBatch) -> None:
        for name, value in fields.items():
            setattr(msg.entries[0].key, name, value)

    return apply


def _entry(**fields: Any) -> Callable[[events_pb2.CacheEventBatch], None]:
    def apply(msg: events_pb2.CacheEventBatch) -> None:
        for name, value in fields.items():
            setattr(msg.entries[0], name, value)

    return apply


def _config_with_entries(msg: events_pb2.CacheEventBatch) -> None:
    msg.event_type = CONFIG


def _delete_without_backend(msg: events_pb2.CacheEventBatch) -> None:
    msg.event_type = DELETE
    msg.backend = ""


def _config_negative(field: str) -> Callable[[events_pb2.CacheEventBatch], None]:
    def apply(msg: events_pb2.CacheEventBatch) -> None:
        msg.event_type = CONFIG
        del msg.entries[:]
        setattr(msg, field, -1)

    return apply


CASES = [
    Case("empty-instance-id", _set(instance_id=""), "instance_id"),
    Case("store-without-backend", _set(backend=""), "backend"),
    Case("delete-without-backend", _delete_without_backend, "backend"),
    Case("config-with-entries", _config_with_entries, "entries"),
    Case("negative-capacity-bytes", _config_negative("capacity_bytes"), "capacity_bytes"),
    Case("negative-capacity-revision", _config_negative("capacity_revision"), "capacity_revision"),
    Case("negative-incarnation", _set(incarnation=-1), "incarnation"),
    Case("seq-zero", _set(seq=0), "seq"),
    Case("tier-unspecified", _set(tier=common_pb2.TIER_UNSPECIFIED), "tier"),
    Case("tier-all", _set(tier=common_pb2.TIER_ALL), "tier"),
    Case("negative-ts", _set(ts=-1.0), "ts"),
    Case("nan-ts", _set(ts=math.nan), "ts"),
    Case("infinite-ts", _set(ts=math.inf), "ts"),
    Case("milliseconds-ts", _set(ts=1.7e12), "ts"),  # past year 9999 as seconds
    Case(
        "event-type-unspecified",
        _set(event_type=events_pb2.CACHE_EVENT_TYPE_UNSPECIFIED),
        "event_type",
    ),
    Case("event-type-unknown", _set(event_type=42), "event_type"),
    Case("short-chunk-hash", _entry_key(chunk_hash=b"\x01" * 31), "entries[0].key.chunk_hash"),
    Case("long-chunk-hash", _entry_key(chunk_hash=b"\x01" * 33), "entries[0].key.chunk_hash"),
    Case("model-with-at", _entry_key(model_name="org@model"), "entries[0].key.model_name"),
    Case("empty-model", _entry_key(model_name=""), "entries[0].key.model_name"),
    Case("salt-with-slash", _entry_key(cache_salt="a/b"), "entries[0].key.cache_salt"),
    Case("salt-too-long", _entry_key(cache_salt="s" * 129), "entries[0].key.cache_salt"),
    Case("negative-size", _entry(size_bytes=-1), "entries[0].size_bytes"),
    Case("token-offset-minus-two", _entry(token_offset=-2), "entries[0].token_offset"),
]


def _bad_batch(case: Case, instance_id: str) -> events_pb2.CacheEventBatch:
    msg = batch(
        instance_id, 2, tier=L2, entries=[entry(pkey(7), 300, tokens=[1, 2, 3, 4], offset=0)]
    )
    case.breaks(msg)
    return msg


@pytest.fixture(scope="module")
def shared(coord_loop: Any) -> Iterator[Coord]:
    """One coordinator for every case of this module (each case checks its own before/after)."""
    from kvmesh.coordinator.app import CoordinatorApp
    from tests.integration.coordinator.conftest import coord_config
    from tests.integration.coordinator.support import Clients

    server = coord_loop.start(coord_config(), CoordinatorApp)
    coord = Coord(coord_loop, server, Clients.connect(server.target))
    # Some state for the checks to compare: two emitters, both tiers, tokens, a capacity.
    coord.clients.ingest_batches(
        batch("base", 1, entries=stores(range(100, 110))),
        batch("base", 2, tier=L2, entries=[entry(pkey(200), 50, tokens=[9, 9, 9, 9], offset=4)]),
        batch("base", 3, tier=L2, event_type=CONFIG, capacity_bytes=1 << 30, capacity_revision=1),
        batch("base", 4, event_type=ACCESS, backend="", entries=stores([100])),
    )
    try:
        yield coord
    finally:
        coord.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_unary_ingest_rejects_the_whole_request(shared: Coord, case: Case) -> None:
    """Tier all, seq 0, a bad key hash, a bad event type and a negative size are refused."""
    c = shared.clients
    instance = f"unary-{case.name}"
    before = c.snapshot()
    good = batch(instance, 1, entries=stores([1]))
    with pytest.raises(grpc.RpcError) as info:
        c.ingest_batches(good, _bad_batch(case, instance))
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(info.value) == f"batches[1].{case.field}"
    assert c.snapshot() == before
    assert instance not in c.cursors()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stream_ends_on_the_bad_batch_and_keeps_the_earlier_ones(shared: Coord, case: Case) -> None:
    """A bad tier, seq or key hash, a bad event type and a negative size, on the stream."""
    c = shared.clients
    instance = f"stream-{case.name}"
    node = RawNode(shared.target, instance)
    node.batch(1, entries=stores([1, 2]))
    assert node.verdicts(1) == [(1, 1, ADMITTED)]
    before = c.snapshot()
    bad = _bad_batch(case, instance)
    node.send_batch(bad)
    # Anything after the bad batch is never read.
    node.batch(3, entries=stores([3]))
    error = node.wait_ended()
    assert error is not None
    assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
    # The stream's own instance check runs first for an empty instance id.
    assert field_of(error) == f"batch.{case.field}"
    assert len(node.acks) == 1
    assert c.snapshot() == before
    cursor = c.cursors()[instance]
    assert (cursor.last_seq, cursor.batches_admitted) == (1, 1)
    assert [bool(r.placements) for r in c.lookup(pkey(1), pkey(2), pkey(3)).results] == [
        True,
        True,
        False,
    ]
    node.close()


def test_a_stream_must_start_with_open(make_coord: CoordFactory) -> None:
    coord = make_coord()
    c = coord.clients
    before = c.snapshot()
    node = RawNode(coord.target, "node-a", open_with=None)
    node.batch(1, entries=stores([1]))
    error = node.wait_ended()
    assert error is not None
    assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(error) == "open"
    assert c.snapshot() == before
    node.close()


def test_open_needs_an_instance_id(make_coord: CoordFactory) -> None:
    coord = make_coord()
    empty = ingest_pb2.StreamEventsRequest(open=ingest_pb2.StreamOpen(instance_id=""))
    node = RawNode(coord.target, "", open_with=empty)
    error = node.wait_ended()
    assert error is not None
    assert (code_of(error), field_of(error)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "open.instance_id",
    )
    node.close()


def test_a_second_open_ends_the_stream(make_coord: CoordFactory) -> None:
    coord = make_coord()
    node = coord.node("node-a")
    node.batch(1, entries=stores([1]))
    node.wait_acks(1)
    node.send(ingest_pb2.StreamEventsRequest(open=ingest_pb2.StreamOpen(instance_id="node-a")))
    error = node.wait_ended()
    assert error is not None
    assert (code_of(error), field_of(error)) == (grpc.StatusCode.INVALID_ARGUMENT, "open")
    node.close()


def test_a_batch_of_another_instance_ends_the_stream(make_coord: CoordFactory) -> None:
    coord = make_coord()
    c = coord.clients
    node = coord.node("node-a")
    node.batch(1, entries=stores([1]))
    node.wait_acks(1)
    before = c.snapshot()
    node.send_batch(batch("node-b", 1, entries=stores([2])))
    error = node.wait_ended()
    assert error is not None
    assert (code_of(error), field_of(error)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "batch.instance_id",
    )
    assert c.snapshot() == before
    assert "node-b" not in c.cursors()
    node.close()


def test_access_may_have_an_empty_backend_and_config_no_entries(make_coord: CoordFactory) -> None:
    """The two exemptions of the backend and entries rules are accepted (ACCESS)."""
    coord = make_coord()
    response = coord.clients.ingest_batches(
        batch("node-a", 1, entries=stores([1])),
        batch("node-a", 2, event_type=ACCESS, backend="", entries=stores([1])),
        batch("node-a", 3, event_type=CONFIG, tier=L2, capacity_bytes=0, capacity_revision=0),
        batch("node-a", 4, event_type=STORE, entries=[entry(pkey(2), 0, offset=-1)]),
    )
    assert list(response.results) == [ADMITTED] * 4
    assert coord.clients.lookup(pkey(1)).results[0].access_count == 1
