"""GrpcMembershipClient and the registrar against a real MembershipService over a socket."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvmesh.common.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.storage.events.grpc_membership import GrpcMembershipClient
from kvmesh.storage.events.registrar import Registrar, Registration
from tests.support.fake_coordinator import CoordinatorHandle
from tests.support.ports import free_port
from tests.support.waiting import wait_until

NODE = "node-a"


def _client(target: str, **changes: object) -> GrpcMembershipClient:
    settings: dict[str, object] = {
        "incarnation": 7,
        "gateway_address": "10.0.0.5:50051",
        "storage_address": "10.0.0.5:50052",
        "metrics_address": "10.0.0.5:9090",
    }
    settings.update(changes)
    return GrpcMembershipClient(target, **settings)  # type: ignore[arg-type]


@pytest.fixture
def client(coordinator: CoordinatorHandle) -> Iterator[GrpcMembershipClient]:
    membership = _client(coordinator.target)
    try:
        yield membership
    finally:
        membership.close()


def test_register_sends_identity_endpoints_and_metadata_and_returns_seconds(
    coordinator: CoordinatorHandle, client: GrpcMembershipClient
) -> None:
    first = client.register(NODE, {"version": "0.1.0"})
    assert first == Registration(NODE, False, 0.05, 1.5)
    assert client.register(NODE, {}).re_registered
    record = coordinator.state.instances[NODE].request
    assert record.incarnation == 7
    assert record.endpoints.gateway_address == "10.0.0.5:50051"
    assert record.endpoints.storage_address == "10.0.0.5:50052"
    assert record.endpoints.metrics_address == "10.0.0.5:9090"
    assert dict(record.metadata) == {}


def test_status_codes_come_back_as_core_errors(
    coordinator: CoordinatorHandle, client: GrpcMembershipClient
) -> None:
    with pytest.raises(NotFound, match="NOT_FOUND"):
        client.heartbeat("never-registered")
    with pytest.raises(InvalidArgument):
        client.register("", {})
    client.register(NODE, {})
    client.heartbeat(NODE)
    client.deregister(NODE)
    client.deregister(NODE)  # idempotent
    assert NODE not in coordinator.state.instances


def test_an_absent_coordinator_is_unavailable_within_the_deadline(
    no_new_threads: Callable[[], None],
) -> None:
    client = _client(f"127.0.0.1:{free_port()}", call_timeout_s=1.0)
    try:
        with pytest.raises(Unavailable):
            client.heartbeat(NODE)
    finally:
        client.close()
    no_new_threads()


def test_registrar_registers_heartbeats_and_deregisters_on_stop(
    coordinator: CoordinatorHandle, client: GrpcMembershipClient
) -> None:
    state = coordinator.state
    seen: list[Registration] = []
    registrar = Registrar(
        client, NODE, {"incarnation": "7"}, heartbeat_interval_s=5.0, on_registered=seen.append
    )
    registrar.start()
    try:
        # The coordinator's 50 ms interval replaces our 5 s one after registering.
        state.wait_for(lambda: NODE in state.instances and state.instances[NODE].heartbeats >= 3)
        assert registrar.heartbeat_interval_s == 0.05
        assert seen == [Registration(NODE, False, 0.05, 1.5)]
        assert dict(state.instances[NODE].request.metadata) == {"incarnation": "7"}
    finally:
        registrar.stop()
    assert NODE not in state.instances
    assert state.deregistrations == 1
    assert registrar.registered_id is None


def test_registrar_registers_again_when_a_heartbeat_is_not_found(
    coordinator: CoordinatorHandle, client: GrpcMembershipClient
) -> None:
    state = coordinator.state
    registrar = Registrar(client, NODE, heartbeat_interval_s=5.0)
    registrar.start()
    try:
        state.wait_for(lambda: NODE in state.instances and state.instances[NODE].heartbeats >= 1)
        state.forget(NODE)  # as a heartbeat timeout on the coordinator would
        wait_until(lambda: registrar.stats().registrations == 2)
        assert registrar.registered_id == NODE
        assert registrar.stats().heartbeats_not_found == 1
        assert (state.registrations, state.heartbeats_not_found) == (2, 1)
        assert NODE in state.instances
    finally:
        registrar.stop()
    assert state.deregistrations == 1


def test_registrar_keeps_trying_until_the_coordinator_appears(
    coordinator_handle: CoordinatorHandle,
) -> None:
    client = _client(coordinator_handle.target, call_timeout_s=0.5)
    registrar = Registrar(client, NODE, heartbeat_interval_s=0.05)
    registrar.start()
    try:
        wait_until(lambda: registrar.stats().errors >= 2)
        assert registrar.registered_id is None
        coordinator_handle.start()
        wait_until(lambda: registrar.registered_id == NODE)
        state = coordinator_handle.state
        state.wait_for(lambda: state.registrations == 1)
    finally:
        registrar.stop()
        client.close()
