"""Health that tells the truth: a gateway whose storage node is unreachable is NOT_SERVING.

A real gateway server is started against a port where nothing listens: its
Health answers NOT_SERVING for GatewayService and overall, and a call that
needs storage fails naming both hops. A real storage server is then started
on that port: the gateway reports SERVING again. Stopping storage flips it
back. Client-side errors name the address and the hop they could not reach.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.gateway.app import SERVICE_NAME, GatewayApp
from kvmesh.gateway.client import GatewayClient
from kvmesh.gateway.config import GatewayConfig
from kvmesh.storage.app import StorageApp
from kvmesh.storage.config import StorageConfig
from tests.integration.gateway.conftest import ShmDirs
from tests.support.harness import ServerThread
from tests.support.ports import free_port
from tests.support.waiting import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(resp.status)


def _both(target: str) -> tuple[int, int]:
    return _health(target, ""), _health(target, SERVICE_NAME)


def test_gateway_reports_not_serving_while_its_storage_is_unreachable(
    thread: ServerThread, shm_dirs: ShmDirs, tmp_path: Path
) -> None:
    storage_port = free_port()
    gateway = thread.start(
        GatewayConfig(
            port=0,
            metrics_port=-1,
            storage_target=f"127.0.0.1:{storage_port}",
            storage_check_seconds=0.1,
            chunk_size=64,
        ),
        GatewayApp,
    )
    target = gateway.target
    # Unreachable from the first probe on: never SERVING.
    assert _both(target) == (NOT_SERVING, NOT_SERVING)

    # A call that needs storage names the hop that failed and its address.
    with GatewayClient(target) as client, pytest.raises(grpc.RpcError) as failed:
        client.clear(gateway_pb2.ClearRequest(), timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert failed.value.details().startswith(
        f"gateway at {target}: cannot reach storage at 127.0.0.1:{storage_port}: "
    ), failed.value.details()

    storage = thread.start(
        StorageConfig(
            port=storage_port,
            metrics_port=-1,
            instance_id="health-node",
            data_dir=str(tmp_path / "data"),
            shm_dir=str(shm_dirs.l1),
            allowed_memory_dir=str(shm_dirs.engine),
            l1_size_bytes=4 << 20,
        ),
        StorageApp,
    )
    wait_until(lambda: _both(target) == (SERVING, SERVING), timeout=30)

    thread.stop(storage)
    wait_until(lambda: _both(target) == (NOT_SERVING, NOT_SERVING), timeout=30)


def test_client_error_names_the_address_and_the_hop() -> None:
    port = free_port()
    with GatewayClient(f"127.0.0.1:{port}") as client, pytest.raises(grpc.RpcError) as failed:
        client.get_chunk_size(gateway_pb2.GetChunkSizeRequest(), timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert failed.value.details().startswith(f"cannot reach gateway at 127.0.0.1:{port}: ")
