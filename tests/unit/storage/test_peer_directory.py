"""The coordinator-backed peer directory's membership cache, read without blocking."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.api.coordinator.v1 import membership_pb2
from kvmesh.storage.core.peer.ports import PeerTarget
from kvmesh.storage.peers import links
from kvmesh.storage.peers.links import MEMBERSHIP_TTL_S, CoordinatorPeerDirectory


class Membership:
    """Stands in for the coordinator's MembershipService; counts the listings."""

    def __init__(self) -> None:
        self.calls = 0

    def list_instances(self, request: Any, timeout: float) -> membership_pb2.ListInstancesResponse:
        self.calls += 1
        endpoints = membership_pb2.InstanceEndpoints(storage_address="127.0.0.1:7001")
        lane = membership_pb2.InstanceEndpoints(storage_address="lane:/tmp/x.lane")
        return membership_pb2.ListInstancesResponse(
            instances=[
                membership_pb2.Instance(instance_id="a", incarnation=3, endpoints=endpoints),
                membership_pb2.Instance(instance_id="b", incarnation=1, endpoints=lane),
            ]
        )


def test_cached_peers_is_the_listing_peers_would_give_and_never_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(links.time, "monotonic", lambda: now[0])
    directory = CoordinatorPeerDirectory("127.0.0.1:1")  # the channel connects lazily
    membership = Membership()
    monkeypatch.setattr(directory, "_membership", membership)
    try:
        assert directory.cached_peers() is None  # nothing listed yet
        assert membership.calls == 0
        listed = directory.peers(1.0)
        assert listed == {"a": PeerTarget("a", "127.0.0.1:7001", 3)}  # lanes are not dialled
        now[0] += MEMBERSHIP_TTL_S / 2
        assert directory.cached_peers() == listed
        assert directory.peers(1.0) == listed
        assert membership.calls == 1  # both answered from the cache
        now[0] += MEMBERSHIP_TTL_S
        assert directory.cached_peers() is None  # expired: peers() would ask again
        assert membership.calls == 1
    finally:
        directory.close()
