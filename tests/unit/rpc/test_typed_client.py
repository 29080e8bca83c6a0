"""The typed-client base over a fake transport: paths, errors, retries, deadlines."""

from __future__ import annotations

from collections.abc import Mapping

import grpc
import pytest

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.coordinator.client import EventIngestClient
from kvmesh.gateway.client import GatewayClient
from kvmesh.rpc.client import CallPolicy, SyncClient
from kvmesh.rpc.errors import RpcError


class FakeTransport:
    """Answers each call with the next of ``answers`` (bytes, or an error to raise)."""

    def __init__(self, *answers: bytes | RpcError) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, bytes, float | None, bool]] = []
        self.closed = False

    def call(
        self, method: str, request: bytes, timeout: float | None, wait_for_ready: bool = False
    ) -> bytes:
        self.calls.append((method, request, timeout, wait_for_ready))
        answer = self.answers.pop(0)
        if isinstance(answer, RpcError):
            raise answer
        return answer

    def close(self) -> None:
        self.closed = True


def _unavailable() -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, "restarting")


def test_a_call_sends_the_method_path_and_the_serialized_request() -> None:
    fake = FakeTransport(gateway_pb2.GetChunkSizeResponse(chunk_size=64).SerializeToString())
    client = GatewayClient("lane:/unused", channel=fake)
    reply = client.get_chunk_size(gateway_pb2.GetChunkSizeRequest(), wait_for_ready=True)
    assert reply.chunk_size == 64
    [(method, request, timeout, wait_for_ready)] = fake.calls
    assert method == "/kvmesh.gateway.v1.GatewayService/GetChunkSize"
    assert request == b""
    assert timeout is not None
    assert 0 < timeout <= GatewayClient.POLICIES["GetChunkSize"].timeout
    assert wait_for_ready
    client.close()
    assert not fake.closed  # shared: the client did not create it
    assert client.channel is None


def test_a_server_side_wait_extends_the_default_deadline() -> None:
    fake = FakeTransport(gateway_pb2.LookupResponse().SerializeToString())
    GatewayClient("x", channel=fake).lookup(gateway_pb2.LookupRequest(wait_timeout_ms=3000))
    timeout = fake.calls[0][2]
    assert timeout is not None
    assert 7.9 < timeout <= GatewayClient.POLICIES["Lookup"].timeout + 3.0


def test_idempotent_calls_are_retried_on_unavailable_only() -> None:
    ok = gateway_pb2.PingResponse().SerializeToString()
    fake = FakeTransport(_unavailable(), _unavailable(), ok)
    assert GatewayClient("x", channel=fake).ping(gateway_pb2.PingRequest()) is not None
    assert len(fake.calls) == 3

    refused = RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    fake = FakeTransport(refused, ok)
    with pytest.raises(RpcError) as err:
        GatewayClient("x", channel=fake).ping(gateway_pb2.PingRequest())
    assert err.value is refused
    assert len(fake.calls) == 1


def test_non_idempotent_calls_are_not_retried() -> None:
    assert not GatewayClient.POLICIES["FreeLookupLocks"].idempotent
    fake = FakeTransport(_unavailable(), gateway_pb2.FreeLookupLocksResponse().SerializeToString())
    with pytest.raises(grpc.RpcError) as err:
        GatewayClient("x", channel=fake).free_lookup_locks(gateway_pb2.FreeLookupLocksRequest())
    assert isinstance(err.value, RpcError)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(fake.calls) == 1


def test_a_response_that_does_not_parse_is_internal() -> None:
    fake = FakeTransport(b"\xff\xff\xff")
    with pytest.raises(RpcError) as err:
        GatewayClient("x", channel=fake).ping(gateway_pb2.PingRequest())
    assert err.value.code() == grpc.StatusCode.INTERNAL


def test_the_error_is_a_grpc_error_and_a_call() -> None:
    error = RpcError(grpc.StatusCode.NOT_FOUND, "gone", b"\x08\x05")
    assert isinstance(error, grpc.RpcError)
    assert isinstance(error, grpc.Call)
    assert (error.code(), error.details()) == (grpc.StatusCode.NOT_FOUND, "gone")
    assert error.trailing_metadata() == (("grpc-status-details-bin", b"\x08\x05"),)


def test_a_stream_needs_grpc() -> None:
    client = EventIngestClient("lane:/unused", channel=FakeTransport())
    with pytest.raises(RpcError) as err:
        client.stream_events(iter(()))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_client_over_a_lane_target_needs_no_server_to_be_created() -> None:
    client = GatewayClient("lane:/nonexistent/socket")
    try:
        with pytest.raises(RpcError) as err:
            client.ping(gateway_pb2.PingRequest(), timeout=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()


class _Tiny(SyncClient):
    SERVICE = "kvmesh.gateway.v1.GatewayService"
    POLICIES: Mapping[str, CallPolicy] = {"Ping": CallPolicy(timeout=0.2, idempotent=True)}


def test_retries_stop_at_the_calls_deadline() -> None:
    fake = FakeTransport(*[_unavailable()] * 10)
    client = _Tiny("x", channel=fake)
    with pytest.raises(RpcError) as err:
        client._call("Ping", gateway_pb2.PingRequest(), gateway_pb2.PingResponse, None, False)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 1 <= len(fake.calls) <= 4  # UNAVAILABLE_RETRIES + 1 at most


def test_a_client_told_not_to_retry_fails_at_the_first_unavailable() -> None:
    """An engine's connector must never wait on kvmesh: one try, then its own back-off."""
    fake = FakeTransport(*[_unavailable()] * 10)
    client = GatewayClient("x", channel=fake, unavailable_retries=0)
    with pytest.raises(RpcError) as err:
        client.ping(gateway_pb2.PingRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(fake.calls) == 1
    default = GatewayClient("x", channel=FakeTransport(*[_unavailable()] * 10))
    with pytest.raises(RpcError):
        default.ping(gateway_pb2.PingRequest(), timeout=5)
    assert len(default.transport.calls) == 4  # type: ignore[attr-defined]  # 1 + 3 retries
