"""StreamEvents batch groups over a real socket (ingest.proto: BatchGroup, AckGroup).

The coordinator announces groups in the stream's initial metadata. A group is
the same as its batches sent one by one: each is checked and ingested in
turn; the acks come one per batch, in order, in one AckGroup. A bad batch
ends the stream INVALID_ARGUMENT naming ``batches.batches[i]``, after the
acks of the batches before it; an oversized group is refused whole.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.api.coordinator.v1 import ingest_pb2, ingest_pb2_grpc
from kvmesh.api.events.v1 import events_pb2
from kvmesh.coordinator.servicers.ingest import BATCH_GROUPS_METADATA, MAX_GROUP_BATCHES
from tests.integration.coordinator.support import (
    ADMITTED,
    DUPLICATE,
    Coord,
    batch,
    code_of,
    field_of,
    pkey,
    stores,
)

Ack = tuple[str, int, int]  # (response kind, seq, result)


class GroupNode:
    """A raw stream that sends any request and records acks with the response kind."""

    def __init__(self, target: str, instance_id: str) -> None:
        self.instance_id = instance_id
        self.channel = grpc.insecure_channel(target)
        self._outbox: queue.SimpleQueue[ingest_pb2.StreamEventsRequest | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self.acks: list[Ack] = []
        self.error: grpc.RpcError | None = None
        self.ended = False
        self.send(
            ingest_pb2.StreamEventsRequest(
                open=ingest_pb2.StreamOpen(instance_id=instance_id, incarnation=1)
            )
        )
        stub = ingest_pb2_grpc.EventIngestServiceStub(self.channel)
        self.call = stub.StreamEvents(self._requests())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[ingest_pb2.StreamEventsRequest]:
        while (item := self._outbox.get()) is not None:
            yield item

    def _read(self) -> None:
        try:
            for response in self.call:
                kind = response.WhichOneof("kind")
                acks = [response.ack] if kind == "ack" else list(response.acks.acks)
                with self._cond:
                    self.acks.extend(
                        (str(kind), a.seq, int(a.result)) for a in acks if kind != "command"
                    )
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            with self._cond:
                self.ended = True
                self._cond.notify_all()

    def send(self, request: ingest_pb2.StreamEventsRequest) -> None:
        self._outbox.put(request)

    def group(self, *msgs: events_pb2.CacheEventBatch) -> None:
        self.send(ingest_pb2.StreamEventsRequest(batches=ingest_pb2.BatchGroup(batches=msgs)))

    def wait_acks(self, n: int) -> list[Ack]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.acks) >= n or self.ended, 10.0)
            return list(self.acks)

    def wait_ended(self) -> grpc.RpcError | None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.ended, 10.0)
        return self.error

    def close(self) -> None:
        self._outbox.put(None)
        self.call.cancel()
        self._reader.join(5.0)
        self.channel.close()


@pytest.fixture
def group_node(coord: Coord) -> Iterator[GroupNode]:
    node = GroupNode(coord.target, "node-g")
    try:
        yield node
    finally:
        node.close()


def test_the_stream_announces_batch_groups_in_its_initial_metadata(group_node: GroupNode) -> None:
    metadata = dict(group_node.call.initial_metadata())
    assert metadata[BATCH_GROUPS_METADATA] == str(MAX_GROUP_BATCHES)


def test_a_group_is_acked_one_per_batch_in_order_in_one_ack_group(
    coord: Coord, group_node: GroupNode
) -> None:
    node = group_node
    node.send(ingest_pb2.StreamEventsRequest(batch=batch("node-g", 1, entries=stores([1]))))
    node.group(
        batch("node-g", 2, entries=stores([2])),
        batch("node-g", 3, entries=stores([3])),
        batch("node-g", 2, entries=stores([99])),  # a replay inside the group
    )
    node.group()  # an empty group: nothing to ack
    node.send(ingest_pb2.StreamEventsRequest(batch=batch("node-g", 4, entries=stores([4]))))
    assert node.wait_acks(5) == [
        ("ack", 1, ADMITTED),
        ("acks", 2, ADMITTED),
        ("acks", 3, ADMITTED),
        ("acks", 2, DUPLICATE),
        ("ack", 4, ADMITTED),
    ]
    found = [bool(r.placements) for r in coord.clients.lookup(*map(pkey, (1, 2, 3, 4, 99))).results]
    assert found == [True, True, True, True, False]
    assert coord.clients.cursors()["node-g"].last_seq == 4


def test_a_bad_batch_in_a_group_ends_the_stream_after_acking_the_ones_before_it(
    coord: Coord, group_node: GroupNode
) -> None:
    node = group_node
    bad = batch("node-g", 3, entries=stores([3]))
    bad.entries[0].key.chunk_hash = b"short"
    node.group(
        batch("node-g", 1, entries=stores([1])),
        batch("node-g", 2, entries=stores([2])),
        bad,
        batch("node-g", 4, entries=stores([4])),
    )
    error = node.wait_ended()
    assert node.acks == [("acks", 1, ADMITTED), ("acks", 2, ADMITTED)]
    assert error is not None
    assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(error) == "batches.batches[2].entries[0].key.chunk_hash"
    cursor = coord.clients.cursors()["node-g"]
    assert (cursor.last_seq, cursor.batches_admitted) == (2, 2)
    assert not coord.clients.lookup(pkey(4)).results[0].placements


def test_a_batch_of_another_instance_in_a_group_is_refused(group_node: GroupNode) -> None:
    group_node.group(batch("node-g", 1, entries=stores([1])), batch("other", 2))
    error = group_node.wait_ended()
    assert group_node.acks == [("acks", 1, ADMITTED)]
    assert error is not None
    assert field_of(error) == "batches.batches[1].instance_id"


def test_a_group_larger_than_announced_is_refused_whole(
    coord: Coord, group_node: GroupNode
) -> None:
    group_node.group(
        *(batch("node-g", i + 1, entries=stores([i])) for i in range(MAX_GROUP_BATCHES + 1))
    )
    error = group_node.wait_ended()
    assert group_node.acks == []
    assert error is not None
    assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(error) == "batches.batches"
    assert "node-g" not in coord.clients.cursors()
