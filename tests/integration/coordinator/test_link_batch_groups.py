"""The storage node's event link sends waiting batches as groups to a coordinator that takes them.

(Against the link's fake coordinator, which announces nothing, the link
never groups: the fake would end the stream on an unknown request kind, so
every test in tests/integration/storage/events pins that side.)
"""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.events import IngestResult
from kvmesh.storage.events.grpc_transport import GrpcEventTransport
from tests.integration.coordinator.support import Coord
from tests.integration.storage.events.support import RecordingListener, store_batch


def test_waiting_batches_go_up_in_groups_and_each_is_acked_in_order(
    coord: Coord, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    real_group = ingest_pb2.BatchGroup

    def spy(**fields: Any) -> ingest_pb2.BatchGroup:
        sizes.append(len(fields["batches"]))
        return real_group(**fields)

    # The link builds its groups with this very module attribute.
    monkeypatch.setattr(ingest_pb2, "BatchGroup", spy)
    transport = GrpcEventTransport(coord.target, connect_timeout_s=2.0, max_group_batches=8)
    try:
        listener = RecordingListener()
        session = transport.connect("node-a", 1, listener)
        for seq in range(1, 401):
            session.send(store_batch(seq))
        listener.wait(lambda: len(listener.acks) == 400)
        assert listener.acks == [(seq, IngestResult.ADMITTED) for seq in range(1, 401)]
        assert sizes
        assert max(sizes) <= 8
        assert min(sizes) >= 2
        assert coord.clients.cursors()["node-a"].last_seq == 400
        session.close()
    finally:
        transport.close()
