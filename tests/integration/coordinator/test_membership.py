"""MembershipService over a real socket: register, heartbeat, deregister, list."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.api.coordinator.v1 import membership_pb2
from tests.integration.coordinator.conftest import CoordFactory
from tests.integration.coordinator.support import (
    ADMITTED,
    L1,
    L2,
    Coord,
    batch,
    code_of,
    field_of,
    pkey,
    stores,
)
from tests.support.waiting import wait_until


def test_register_reregister_and_list(make_coord: CoordFactory) -> None:
    """A registered instance is listed."""
    coord = make_coord(heartbeat_interval_seconds=2.5, instance_timeout_seconds=12.0)
    c = coord.clients
    first = c.membership.register_instance(
        membership_pb2.RegisterInstanceRequest(
            instance_id="node-a",
            incarnation=7,
            endpoints=membership_pb2.InstanceEndpoints(
                storage_address="127.0.0.1:9001", gateway_address="127.0.0.1:9002"
            ),
            metadata={"zone": "z1"},
        )
    )
    assert (first.instance_id, first.re_registered) == ("node-a", False)
    assert (first.heartbeat_interval_ms, first.instance_timeout_ms) == (2500, 12000)
    listed = c.instances()["node-a"]
    assert (listed.incarnation, listed.endpoints.storage_address, dict(listed.metadata)) == (
        7,
        "127.0.0.1:9001",
        {"zone": "z1"},
    )
    assert listed.registered_at.seconds > 0
    assert listed.heartbeat_age_seconds < 5.0
    assert not listed.stream_connected
    again = c.register("node-a", incarnation=8)
    assert again.re_registered
    assert c.instances()["node-a"].incarnation == 8
    assert list(c.instances()) == ["node-a"]


def test_registration_never_touches_the_cursor(coord: Coord) -> None:
    c = coord.clients
    c.ingest_batches(batch("node-a", 1, entries=stores([1])))
    c.register("node-a")
    c.register("node-a")
    assert c.cursors()["node-a"].last_seq == 1
    assert c.placements(pkey(1))


def test_heartbeat_of_a_known_and_an_unknown_instance(coord: Coord) -> None:
    """A registered instance's heartbeat succeeds (LMCache: 200)."""
    c = coord.clients
    c.register("node-a")
    c.membership.heartbeat(membership_pb2.HeartbeatRequest(instance_id="node-a"))
    with pytest.raises(grpc.RpcError) as info:
        c.membership.heartbeat(membership_pb2.HeartbeatRequest(instance_id="ghost"))
    assert code_of(info.value) == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("instance_id", ["", "   ", "a/b", "x" * 257])
def test_register_rejects_a_missing_or_malformed_id(coord: Coord, instance_id: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        coord.clients.register(instance_id)
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(info.value) == "instance_id"
    assert coord.clients.instances() == {}


def test_deregister_fences_l1_keeps_l2_and_forgets_the_cursor(coord: Coord) -> None:
    """Deregistering removes the instance from the list (idempotent)."""
    c = coord.clients
    c.register("node-a")
    c.register("node-b")
    c.ingest_batches(
        batch("node-a", 1, tier=L1, entries=stores([1, 2])),
        batch("node-a", 2, tier=L2, entries=stores([2, 3])),
        batch("node-b", 1, tier=L1, entries=stores([1])),
    )
    response = c.membership.deregister_instance(
        membership_pb2.DeregisterInstanceRequest(instance_id="node-a")
    )
    assert response.existed
    assert list(c.instances()) == ["node-b"]
    assert c.placements(pkey(1)) == [("node-b", 1, L1, "dram", 100)]
    assert c.placements(pkey(2)) == [("node-a", 1, L2, "disk", 100)]
    assert c.placements(pkey(3)) == [("node-a", 1, L2, "disk", 100)]
    assert "node-a" not in c.cursors()
    # L1 usage of the node is gone, L2 stays (its bytes outlive the process).
    usage = {(s.tier, s.cache_salt): s.used_bytes for s in c.usage().salts}
    assert usage == {(L1, ""): 100, (L2, ""): 200}
    # Idempotent; a forgotten cursor accepts any incarnation again.
    again = c.membership.deregister_instance(
        membership_pb2.DeregisterInstanceRequest(instance_id="node-a")
    )
    assert not again.existed
    fresh = c.ingest_batches(batch("node-a", 1, incarnation=0, entries=stores([4])))
    assert list(fresh.results) == [ADMITTED]


def test_list_instances_shows_which_streams_are_open(coord: Coord) -> None:
    c = coord.clients
    c.register("node-a")
    c.register("node-b")
    node = coord.node("node-a")
    wait_until(lambda: c.instances()["node-a"].stream_connected)
    assert not c.instances()["node-b"].stream_connected
    node.close()
    wait_until(lambda: not c.instances()["node-a"].stream_connected)


def test_register_rejects_a_negative_incarnation(coord: Coord) -> None:
    with pytest.raises(grpc.RpcError) as info:
        coord.clients.register("node-a", incarnation=-1)
    assert (code_of(info.value), field_of(info.value)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "incarnation",
    )
