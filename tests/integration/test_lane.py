"""The local lane over real unix sockets: contract parity, bad frames, deadlines, crashes.

Every GatewayService flow also runs over the lane (the ``lane`` arrangement
of tests/integration/gateway). Here: what is the lane's own — its framing,
its errors, its connection handling — against real servers, raw sockets and
a real ``kvmesh gateway`` process killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.common.config import ConfigError
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.client import GatewayClient
from kvmesh.gateway.config import GatewayConfig
from kvmesh.rpc.client import create_aio_channel
from kvmesh.rpc.interceptors import error_info
from kvmesh.rpc.lane import (
    AsyncLaneChannel,
    HandlerCollector,
    LaneChannel,
    LaneServer,
)
from kvmesh.rpc.server import Server
from tests.harness import REPO_ROOT, ServerThread, free_port, server_thread, spawn_cli, wait_for

GATEWAY = "/kvmesh.gateway.v1.GatewayService/"
HELLO = struct.Struct("<8sI")
REQUEST = struct.Struct("<IIIHH")
RESPONSE = struct.Struct("<IIB3x")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for sockets (unix socket paths are limited to ~107 bytes)."""
    path = Path("/tmp") / f"kvmesh-lane-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


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


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("closed")
        data += chunk
    return data


def frame(call_id: int, method: str, payload: bytes, *, declared: int | None = None) -> bytes:
    m = method.encode()
    size = len(payload) if declared is None else declared
    return REQUEST.pack(size, call_id, 0, len(m), 0) + m + payload


def read_reply(sock: socket.socket) -> tuple[int, int, bytes]:
    size, call_id, code = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
    return call_id, code, recv_exact(sock, size)


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
    channel = LaneChannel(str(server.lane.path))
    try:
        stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[arg-type]
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as err:
            stub.Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "streaming" in err.value.details()
    finally:
        channel.close()


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
    with raw_connect(server) as sock:
        for i in range(200):
            sock.sendall(frame(i + 1, f"{GATEWAY}Made{i}", b""))
            assert read_reply(sock)[:2] == (i + 1, grpc.StatusCode.UNIMPLEMENTED.value[0])
        sock.sendall(frame(999, GATEWAY + "Ping", b""))
        assert read_reply(sock)[:2] == (999, 0)
    assert list(server.lane._methods) == [GATEWAY + "Ping"]


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


def test_a_non_ascii_method_closes_the_connection(gateway: tuple[ServerThread, Server]) -> None:
    _, server = gateway
    with raw_connect(server) as sock:
        method = "/é".encode()
        sock.sendall(REQUEST.pack(0, 1, 0, len(method), 0) + method)
        assert sock.recv(1) == b""


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


# -- connections, deadlines, crashes -----------------------------------------------------


class _SlowHealth(health_pb2_grpc.HealthServicer):
    """Check sleeps for the number of milliseconds named in ``service``."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.finished: list[str] = []

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 - the RPC's name
        try:
            await asyncio.sleep(int(request.service or "0") / 1000.0)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished.append(request.service)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def slow_lane(sock_dir: Path) -> Iterator[tuple[ServerThread, LaneServer, _SlowHealth]]:
    servicer = _SlowHealth()
    handlers = HandlerCollector()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, handlers)  # type: ignore[arg-type]
    lane = LaneServer(
        str(sock_dir / "slow.sock"), handlers, intercept=None, max_message_bytes=1 << 20
    )
    with server_thread() as thread:
        thread.run(lane.start())
        try:
            yield thread, lane, servicer
        finally:
            thread.run(lane.stop(0.5))


def _check(channel: LaneChannel, delay_ms: int, timeout: float = 10.0) -> Any:
    stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[arg-type]
    return stub.Check(health_pb2.HealthCheckRequest(service=str(delay_ms)), timeout=timeout)


def test_a_passed_deadline_is_deadline_exceeded_and_cancels_the_handler(
    slow_lane: tuple[ServerThread, LaneServer, _SlowHealth],
) -> None:
    _, lane, servicer = slow_lane
    channel = LaneChannel(str(lane.path))
    try:
        with pytest.raises(grpc.RpcError) as err:
            _check(channel, 5000, timeout=0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The client dropped the connection; the server cancelled the call.
        assert servicer.cancelled.wait(5)
        assert "5000" not in servicer.finished
        assert _check(channel, 0).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


def test_calls_on_one_connection_are_answered_out_of_order_by_call_id(
    slow_lane: tuple[ServerThread, LaneServer, _SlowHealth],
) -> None:
    _, lane, _ = slow_lane
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(lane.path))
        recv_exact(sock, HELLO.size)
        slow = health_pb2.HealthCheckRequest(service="300").SerializeToString()
        fast = health_pb2.HealthCheckRequest(service="0").SerializeToString()
        method = "/grpc.health.v1.Health/Check"
        sock.sendall(frame(1, method, slow) + frame(2, method, fast))
        first, second = read_reply(sock), read_reply(sock)
    assert (first[0], first[1]) == (2, 0)
    assert (second[0], second[1]) == (1, 0)


def test_threads_share_one_channel(
    slow_lane: tuple[ServerThread, LaneServer, _SlowHealth],
) -> None:
    _, lane, servicer = slow_lane
    channel = LaneChannel(str(lane.path))
    failures: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(25):
                assert _check(channel, 1).status == health_pb2.HealthCheckResponse.SERVING
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    channel.close()
    assert failures == []
    assert len(servicer.finished) == 200


def test_a_forked_child_opens_its_own_connection(
    slow_lane: tuple[ServerThread, LaneServer, _SlowHealth],
) -> None:
    _, lane, _ = slow_lane
    channel = LaneChannel(str(lane.path))
    try:
        _check(channel, 0)  # the parent now holds an idle connection
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            try:
                ok = all(_check(channel, 0).status == 1 for _ in range(20))
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        for _ in range(20):
            assert _check(channel, 0).status == health_pb2.HealthCheckResponse.SERVING
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        channel.close()


def test_no_server_is_unavailable_and_wait_for_ready_waits_for_one(sock_dir: Path) -> None:
    path = sock_dir / "later.sock"
    channel = LaneChannel(str(path))
    stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[arg-type]
    request = health_pb2.HealthCheckRequest(service="0")
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(request, timeout=0.3, wait_for_ready=True)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        handlers = HandlerCollector()
        health_pb2_grpc.add_HealthServicer_to_server(_SlowHealth(), handlers)  # type: ignore[arg-type]
        lane = LaneServer(str(path), handlers, intercept=None, max_message_bytes=1 << 20)
        with server_thread() as thread:
            result: list[Any] = []
            waiter = threading.Thread(
                target=lambda: result.append(stub.Check(request, timeout=10, wait_for_ready=True))
            )
            waiter.start()
            time.sleep(0.3)
            thread.run(lane.start())
            waiter.join(10)
            thread.run(lane.stop(0.5))
        assert result
        assert result[0].status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


def test_a_socket_that_is_not_a_lane_is_unavailable(sock_dir: Path) -> None:
    path = sock_dir / "other.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)

    def speak_something_else() -> None:
        conn, _ = listener.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    server = threading.Thread(target=speak_something_else)
    server.start()
    channel = LaneChannel(str(path))
    try:
        with pytest.raises(grpc.RpcError) as err:
            _check(channel, 0, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "lane version 1" in err.value.details()
    finally:
        channel.close()
        server.join(5)
        listener.close()


def test_stop_lets_a_call_in_flight_finish(sock_dir: Path) -> None:
    servicer = _SlowHealth()
    handlers = HandlerCollector()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, handlers)  # type: ignore[arg-type]
    lane = LaneServer(str(sock_dir / "g.sock"), handlers, intercept=None, max_message_bytes=4096)
    channel = LaneChannel(str(lane.path))
    with server_thread() as thread:
        thread.run(lane.start())
        result: list[Any] = []
        caller = threading.Thread(target=lambda: result.append(_check(channel, 300)))
        caller.start()
        wait_for(lambda: bool(lane._connections))
        time.sleep(0.05)
        thread.run(lane.stop(5.0))
        caller.join(10)
    channel.close()
    assert result
    assert result[0].status == health_pb2.HealthCheckResponse.SERVING
    assert not lane.path.exists()


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
        wait_for(ready.exists, timeout=30)
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
        wait_for(ready.exists, timeout=30)
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
from tests.harness import server_thread
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
name = "kvmesh.gateway.v1.GatewayService/GetChunkSize"
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


# -- the asyncio client (a service calling another on its host) ---------------------------


def _astub(channel: AsyncLaneChannel) -> Any:
    return health_pb2_grpc.HealthStub(channel)  # type: ignore[arg-type]


def test_async_calls_share_one_connection_and_are_paired_by_call_id(
    slow_lane: tuple[ServerThread, LaneServer, _SlowHealth],
) -> None:
    _, lane, servicer = slow_lane

    async def scenario() -> list[str]:
        async with AsyncLaneChannel(str(lane.path)) as channel:
            stub = _astub(channel)
            delays = [200, 0, 100, 0, 50]
            replies = await asyncio.gather(
                *(
                    stub.Check(health_pb2.HealthCheckRequest(service=str(d)), timeout=10)
                    for d in delays
                )
            )
            assert all(r.status == health_pb2.HealthCheckResponse.SERVING for r in replies)
            assert len(lane._connections) == 1
            return list(servicer.finished)

    finished = asyncio.run(scenario())
    # Answered as they finished, not as they were sent.
    assert finished.index("0") < finished.index("50") < finished.index("100")
    assert finished.index("100") < finished.index("200")


def test_an_async_deadline_cancels_only_that_call_on_the_server(
    slow_lane: tuple[ServerThread, LaneServer, _SlowHealth],
) -> None:
    _, lane, servicer = slow_lane

    async def scenario() -> None:
        async with AsyncLaneChannel(str(lane.path)) as channel:
            stub = _astub(channel)
            survivor = asyncio.ensure_future(
                stub.Check(health_pb2.HealthCheckRequest(service="400"), timeout=10)
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Check(health_pb2.HealthCheckRequest(service="5000"), timeout=0.2)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await survivor).status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(scenario())
    assert servicer.cancelled.wait(5)
    assert "5000" not in servicer.finished
    assert "400" in servicer.finished


def test_a_cancelled_async_caller_cancels_its_call_on_the_server(
    slow_lane: tuple[ServerThread, LaneServer, _SlowHealth],
) -> None:
    _, lane, servicer = slow_lane

    async def scenario() -> None:
        async with AsyncLaneChannel(str(lane.path)) as channel:
            call = asyncio.ensure_future(
                _astub(channel).Check(health_pb2.HealthCheckRequest(service="5000"), timeout=10)
            )
            await asyncio.sleep(0.2)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(scenario())
    assert servicer.cancelled.wait(5)


def test_async_calls_in_flight_fail_unavailable_when_the_server_goes(sock_dir: Path) -> None:
    servicer = _SlowHealth()
    handlers = HandlerCollector()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, handlers)  # type: ignore[arg-type]
    lane = LaneServer(str(sock_dir / "gone.sock"), handlers, intercept=None, max_message_bytes=4096)
    with server_thread() as thread:
        thread.run(lane.start())

        async def scenario() -> None:
            async with AsyncLaneChannel(str(lane.path)) as channel:
                stub = _astub(channel)
                call = asyncio.ensure_future(
                    stub.Check(health_pb2.HealthCheckRequest(service="5000"), timeout=10)
                )
                await asyncio.sleep(0.2)
                await asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(lane.stop(0.0), thread.loop)
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(health_pb2.HealthCheckRequest(service="0"), timeout=2)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        asyncio.run(scenario())


def test_async_errors_carry_the_error_info_like_grpc(gateway: tuple[ServerThread, Server]) -> None:
    _, server = gateway
    assert server.lane is not None
    lane_target = server.lane.target

    async def scenario() -> None:
        channel = create_aio_channel(lane_target)
        try:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.QueryPrefetchStatus(
                    gateway_pb2.QueryPrefetchStatusRequest(request_id="nobody"), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            info = error_info(err.value)
            assert info is not None
            assert info.reason == "UNKNOWN_REQUEST"
            size = await stub.GetChunkSize(gateway_pb2.GetChunkSizeRequest(), timeout=5)
            assert size.chunk_size == 16
        finally:
            await channel.close()

    asyncio.run(scenario())


def test_async_wait_for_ready_waits_for_the_server(sock_dir: Path) -> None:
    path = sock_dir / "late.sock"
    handlers = HandlerCollector()
    health_pb2_grpc.add_HealthServicer_to_server(_SlowHealth(), handlers)  # type: ignore[arg-type]
    lane = LaneServer(str(path), handlers, intercept=None, max_message_bytes=4096)
    with server_thread() as thread:

        async def scenario() -> None:
            async with AsyncLaneChannel(str(path)) as channel:
                stub = _astub(channel)
                request = health_pb2.HealthCheckRequest(service="0")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(request, timeout=2)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                waiting = asyncio.ensure_future(
                    stub.Check(request, timeout=10, wait_for_ready=True)
                )
                await asyncio.sleep(0.3)
                assert not waiting.done()
                await asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(lane.start(), thread.loop)
                )
                assert (await waiting).status == health_pb2.HealthCheckResponse.SERVING

        asyncio.run(scenario())
        thread.run(lane.stop(0.5))


# -- calls start at once; a call that waits keeps its context ----------------------------

_REQUEST_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="")


class _ContextHealth(health_pb2_grpc.HealthServicer):
    """Sets a context variable, waits, resets it: what a tracing span does around a wait."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 - the RPC's name
        token = _REQUEST_VAR.set(request.service)
        if request.service.startswith("wait"):
            await asyncio.sleep(0.01)
        self.seen.append((request.service, _REQUEST_VAR.get()))
        _REQUEST_VAR.reset(token)  # raises ValueError in any other context
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_calls_that_wait_keep_their_own_context_and_quick_ones_leave_none_behind(
    sock_dir: Path,
) -> None:
    servicer = _ContextHealth()
    handlers = HandlerCollector()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, handlers)  # type: ignore[arg-type]
    lane = LaneServer(str(sock_dir / "ctx.sock"), handlers, intercept=None, max_message_bytes=4096)
    method = "/grpc.health.v1.Health/Check"
    with server_thread() as thread:
        thread.run(lane.start())
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(lane.path))
            recv_exact(sock, HELLO.size)
            names = ["wait-a", "quick-b", "wait-c", "quick-d"]
            frames = [
                frame(i, method, health_pb2.HealthCheckRequest(service=name).SerializeToString())
                for i, name in enumerate(names, start=1)
            ]
            sock.sendall(b"".join(frames))  # one read: all four start from one callback
            replies = sorted(read_reply(sock)[:2] for _ in names)
        thread.run(lane.stop(1.0))
    assert replies == [(1, 0), (2, 0), (3, 0), (4, 0)]  # every reset found its own token
    assert sorted(servicer.seen) == sorted((n, n) for n in names)
    # The quick calls ran before the waiting ones finished, and nothing leaked between them.
    assert [n for n, _ in servicer.seen[:2]] == ["quick-b", "quick-d"]
