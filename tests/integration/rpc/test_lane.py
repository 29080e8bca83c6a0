"""The local lane over real unix sockets: contract parity, bad frames, the socket path, crashes.

Every GatewayService flow also runs over the lane (the ``lane`` arrangement
of tests/integration/gateway). Here: what is the lane's own — its framing,
its errors, its socket — against real servers, raw sockets and a real
``kvmesh gateway`` process killed with SIGKILL. Connections and deadlines
are in tests/integration/rpc/test_lane_connections.py, the asyncio client in
tests/integration/rpc/test_lane_async.py, and the frame parser alone in
tests/unit/rpc/test_lane_framing.py.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.common.config import ConfigError
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.client import GatewayClient
from kvmesh.gateway.config import GatewayConfig
from kvmesh.rpc.errors import RpcError, error_info
from kvmesh.rpc.lane.client import AsyncLaneTransport, LaneTransport
from kvmesh.rpc.server import Server
from tests.integration.rpc.lane_support import (
    CHECK,
    GATEWAY,
    HELLO,
    REQUEST,
    frame,
    read_reply,
    recv_exact,
)
from tests.support.harness import REPO_ROOT, ServerThread, server_thread, spawn_cli
from tests.support.ports import free_port
from tests.support.waiting import wait_until


@pytest.fixture
def gateway(sock_dir: Path) -> Iterator[tuple[ServerThread, Server]]:
    """A gateway (no storage behind it: not needed here) serving gRPC and the lane."""
    with server_thread() as thread:
        config = GatewayConfig(
            port=0,
            storage_target=f"127.0.0.1:{free_port()}",
            chunk_size=16,
            lane_socket=str(sock_dir / "gw.sock"),
            max_message_bytes=64 * 1024,
        )
        yield thread, thread.start(config, GatewayApp)


def lane_client(server: Server) -> GatewayClient:
    assert server.lane is not None
    return GatewayClient(server.lane.target)


def raw_connect(server: Server) -> socket.socket:
    """A raw socket to the lane, past the server's hello."""
    assert server.lane is not None
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(str(server.lane.path))
    magic, limit = HELLO.unpack(recv_exact(sock, HELLO.size))
    assert magic == b"KVMLANE1"
    assert limit == 64 * 1024
    return sock


# -- contract parity ---------------------------------------------------------------------


def test_the_lane_answers_like_grpc(gateway: tuple[ServerThread, Server]) -> None:
    _, server = gateway
    over_grpc = GatewayClient(server.target)
    over_lane = lane_client(server)
    try:
        ping = gateway_pb2.PingRequest()
        assert over_lane.ping(ping) == over_grpc.ping(ping)
        size = gateway_pb2.GetChunkSizeRequest()
        assert over_lane.get_chunk_size(size).chunk_size == 16
        assert over_lane.get_chunk_size(size) == over_grpc.get_chunk_size(size)
        unknown = gateway_pb2.QueryPrefetchStatusRequest(request_id="nobody")
        errors = []
        for client in (over_grpc, over_lane):
            with pytest.raises(grpc.RpcError) as err:
                client.query_prefetch_status(unknown)
            errors.append(err.value)
        assert [e.code() for e in errors] == [grpc.StatusCode.NOT_FOUND] * 2
        assert errors[0].details() == errors[1].details()
        infos = [error_info(e) for e in errors]
        assert infos[0] is not None
        assert infos[0] == infos[1]
    finally:
        over_grpc.close()
        over_lane.close()


def test_lane_calls_are_counted_in_the_rpc_metrics(sock_dir: Path) -> None:
    with server_thread() as thread:
        config = GatewayConfig(
            port=0,
            storage_target=f"127.0.0.1:{free_port()}",
            lane_socket=str(sock_dir / "m.sock"),
        )
        server = thread.start(config, GatewayApp)
        client = lane_client(server)
        try:
            for _ in range(3):
                client.get_chunk_size(gateway_pb2.GetChunkSizeRequest())
            with pytest.raises(grpc.RpcError):
                client.query_prefetch_status(
                    gateway_pb2.QueryPrefetchStatusRequest(request_id="nobody")
                )
        finally:
            client.close()
        assert server.metrics is not None
        with urllib.request.urlopen(f"http://{server.metrics.address}/metrics") as reply:
            body = reply.read().decode()
    assert (
        'kvmesh_rpc_requests_total{code="OK",method="GetChunkSize",service="gateway"} 3.0' in body
    )
    assert 'kvmesh_rpc_errors_total{code="NOT_FOUND",method="QueryPrefetchStatus"' in body


def test_the_ready_endpoints_name_the_lane(gateway: tuple[ServerThread, Server]) -> None:
    _, server = gateway
    assert server.lane is not None
    assert server.endpoints()["lane"] == f"lane:{server.lane.path}"


def test_streaming_rpcs_and_unknown_methods_are_unimplemented(
    gateway: tuple[ServerThread, Server], sock_dir: Path
) -> None:
    _, server = gateway
    assert server.lane is not None
    request = health_pb2.HealthCheckRequest().SerializeToString()
    with LaneTransport(str(server.lane.path)) as lane:
        for method in (CHECK, "/grpc.health.v1.Health/Watch", GATEWAY + "NoSuchMethod"):
            with pytest.raises(RpcError) as err:
                lane.call(method, request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "streaming" in err.value.details()


# -- bad frames --------------------------------------------------------------------------


def test_a_request_that_does_not_parse_is_invalid_argument_and_the_connection_lives(
    gateway: tuple[ServerThread, Server],
) -> None:
    _, server = gateway
    with raw_connect(server) as sock:
        sock.sendall(frame(7, GATEWAY + "Lookup", b"\xff\xff\xff"))
        call_id, code, body = read_reply(sock)
        assert (call_id, code) == (7, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        assert "does not parse" in status_pb2.Status.FromString(body).message
        sock.sendall(frame(8, GATEWAY + "NoSuchMethod", b""))
        call_id, code, body = read_reply(sock)
        assert (call_id, code) == (8, grpc.StatusCode.UNIMPLEMENTED.value[0])
        sock.sendall(frame(9, GATEWAY + "GetChunkSize", b""))
        call_id, code, body = read_reply(sock)
        assert (call_id, code) == (9, 0)
        assert gateway_pb2.GetChunkSizeResponse.FromString(body).chunk_size == 16


def test_made_up_method_names_do_not_grow_the_servers_method_table(
    gateway: tuple[ServerThread, Server],
) -> None:
    _, server = gateway
    assert server.lane is not None
    unary = [m.name for m in gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].methods]
    assert sorted(server.lane.methods) == sorted(GATEWAY + name for name in unary)
    with raw_connect(server) as sock:
        for i in range(200):
            sock.sendall(frame(i + 1, f"{GATEWAY}Made{i}", b""))
            assert read_reply(sock)[:2] == (i + 1, grpc.StatusCode.UNIMPLEMENTED.value[0])
        sock.sendall(frame(999, GATEWAY + "Ping", b""))
        assert read_reply(sock)[:2] == (999, 0)
    assert sorted(server.lane.methods) == sorted(GATEWAY + name for name in unary)


def test_an_oversized_frame_is_refused_and_its_connection_closed(
    gateway: tuple[ServerThread, Server],
) -> None:
    _, server = gateway
    with raw_connect(server) as sock:
        sock.sendall(frame(3, GATEWAY + "Ping", b"", declared=10 * 1024 * 1024))
        call_id, code, body = read_reply(sock)
        assert (call_id, code) == (3, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
        assert "max_message_bytes" in status_pb2.Status.FromString(body).message
        assert sock.recv(1) == b""  # closed by the server
    # The server itself is unharmed.
    client = lane_client(server)
    try:
        assert client.get_chunk_size(gateway_pb2.GetChunkSizeRequest()).chunk_size == 16
    finally:
        client.close()


def test_a_non_ascii_method_is_invalid_argument_and_the_connection_lives(
    gateway: tuple[ServerThread, Server],
) -> None:
    _, server = gateway
    with raw_connect(server) as sock:
        method = "/é".encode()
        sock.sendall(REQUEST.pack(0, 1, 0, len(method), 0) + method)
        call_id, code, body = read_reply(sock)
        assert (call_id, code) == (1, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        status = status_pb2.Status.FromString(body)
        assert "not ASCII" in status.message
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        sock.sendall(frame(2, GATEWAY + "GetChunkSize", b""))
        assert read_reply(sock)[:2] == (2, 0)


def test_frames_split_and_batched_arbitrarily_are_all_answered(
    gateway: tuple[ServerThread, Server],
) -> None:
    _, server = gateway
    data = b"".join(frame(i, GATEWAY + "GetChunkSize", b"") for i in range(1, 21))
    with raw_connect(server) as sock:
        for i in range(0, len(data), 7):  # 7-byte pieces: headers split mid-field
            sock.sendall(data[i : i + 7])
            time.sleep(0.001)
        replies = sorted(read_reply(sock)[:2] for _ in range(20))
    assert replies == [(i, 0) for i in range(1, 21)]


def test_a_request_over_the_servers_limit_fails_before_sending(
    gateway: tuple[ServerThread, Server],
) -> None:
    _, server = gateway
    client = lane_client(server)
    try:
        huge = gateway_pb2.LookupRequest(
            request_id="r", model_name="m", world_size=1, token_ids=list(range(20_000))
        )
        with pytest.raises(grpc.RpcError) as err:
            client.lookup(huge)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.get_chunk_size(gateway_pb2.GetChunkSizeRequest()).chunk_size == 16
    finally:
        client.close()


# -- the socket path ---------------------------------------------------------------------


def test_a_live_lane_socket_is_not_stolen(
    gateway: tuple[ServerThread, Server], sock_dir: Path
) -> None:
    thread, server = gateway
    assert server.lane is not None
    second = GatewayConfig(port=0, storage_target="127.0.0.1:1", lane_socket=str(server.lane.path))
    with pytest.raises(ConfigError, match="a server is using it"):
        thread.start(second, GatewayApp)


def test_a_regular_file_at_the_lane_path_is_refused(sock_dir: Path) -> None:
    path = sock_dir / "file"
    path.write_text("not a socket")
    with server_thread() as thread:
        config = GatewayConfig(port=0, storage_target="127.0.0.1:1", lane_socket=str(path))
        with pytest.raises(ConfigError, match=r"lane_socket .* exists and is not a socket"):
            thread.start(config, GatewayApp)
    assert path.read_text() == "not a socket"


def test_a_stale_lane_socket_is_replaced(sock_dir: Path) -> None:
    path = sock_dir / "stale.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: what a SIGKILLed server leaves
    with server_thread() as thread:
        config = GatewayConfig(port=0, storage_target="127.0.0.1:1", lane_socket=str(path))
        server = thread.start(config, GatewayApp)
        client = lane_client(server)
        try:
            assert client.ping(gateway_pb2.PingRequest()) is not None
        finally:
            client.close()
        thread.stop(server)
    assert not path.exists()  # removed on stop


def test_lane_and_grpc_unix_socket_must_differ(sock_dir: Path) -> None:
    path = str(sock_dir / "same.sock")
    config = GatewayConfig(port=0, storage_target="x:1", unix_socket=path, lane_socket=path)
    with pytest.raises(ConfigError, match="different paths"):
        config.validate()


# -- processes: crashes, signals, traces -------------------------------------------------


def spawn_gateway(lane_path: Path, ready: Path) -> subprocess.Popen[str]:
    """A ``kvmesh gateway`` process serving its lane (its storage node is never dialled)."""
    flags = {
        "--port": "0",
        "--metrics-port": "-1",
        "--storage-target": f"127.0.0.1:{free_port()}",
        "--lane-socket": str(lane_path),
        "--ready-file": str(ready),
    }
    return spawn_cli("gateway", *(part for pair in flags.items() for part in pair))


def test_a_sigkilled_gateway_process_is_unavailable_not_a_hang(sock_dir: Path) -> None:
    lane_path = sock_dir / "proc.sock"
    ready = sock_dir / "ready.json"
    process = spawn_gateway(lane_path, ready)
    client = GatewayClient(f"lane:{lane_path}")
    try:
        wait_until(ready.exists, timeout=30)
        assert client.get_chunk_size(gateway_pb2.GetChunkSizeRequest()).chunk_size == 256
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        with pytest.raises(grpc.RpcError) as err:
            client.get_chunk_size(gateway_pb2.GetChunkSizeRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)
        ready.unlink(missing_ok=True)
        lane_path.unlink(missing_ok=True)


def test_sigterm_removes_the_lane_socket(sock_dir: Path) -> None:
    lane_path = sock_dir / "term.sock"
    ready = sock_dir / "ready.json"
    process = spawn_gateway(lane_path, ready)
    try:
        wait_until(ready.exists, timeout=30)
        assert lane_path.is_socket()
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        assert not lane_path.exists()
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


def test_traces_cross_the_lane(sock_dir: Path) -> None:
    # Own interpreter: a tracer provider is process-wide and would trace every later test.
    script = f"""
import asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.client import GatewayClient
from kvmesh.gateway.config import GatewayConfig
from tests.support.harness import server_thread
with server_thread() as thread:
    config = GatewayConfig(
        port=0, storage_target="127.0.0.1:1", lane_socket={str(sock_dir / "t.sock")!r}
    )
    server = thread.start(config, GatewayApp)
    client = GatewayClient(server.lane.target)
    with trace.get_tracer("test").start_as_current_span("engine-step") as root:
        client.get_chunk_size(gateway_pb2.GetChunkSizeRequest())
    client.close()
spans = {{s.name: s for s in exporter.get_finished_spans()}}
name = "/kvmesh.gateway.v1.GatewayService/GetChunkSize"  # as gRPC names it
finished = [s for s in exporter.get_finished_spans() if s.name == name]
server_span = [s for s in finished if s.kind.name == "SERVER"]
client_span = [s for s in finished if s.kind.name == "CLIENT"]
assert server_span and client_span, sorted(spans)
tid = root.get_span_context().trace_id
assert server_span[0].context.trace_id == tid
assert client_span[0].context.trace_id == tid
assert server_span[0].parent.span_id == client_span[0].context.span_id
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def test_async_errors_carry_the_error_info_like_grpc(gateway: tuple[ServerThread, Server]) -> None:
    _, server = gateway
    assert server.lane is not None
    path = str(server.lane.path)

    async def scenario() -> None:
        async with AsyncLaneTransport(path) as lane:
            unknown = gateway_pb2.QueryPrefetchStatusRequest(request_id="nobody")
            with pytest.raises(grpc.RpcError) as err:
                await lane.call(GATEWAY + "QueryPrefetchStatus", unknown.SerializeToString(), 5)
            assert isinstance(err.value, RpcError)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            info = error_info(err.value)
            assert info is not None
            assert info.reason == "UNKNOWN_REQUEST"
            body = await lane.call(GATEWAY + "GetChunkSize", b"", 5)
            assert gateway_pb2.GetChunkSizeResponse.FromString(body).chunk_size == 16

    asyncio.run(scenario())
