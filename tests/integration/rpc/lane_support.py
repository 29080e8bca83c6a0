"""Helpers of the local lane's integration tests: raw frames, a slow Health servicer, lanes.

Used by tests/integration/rpc/test_lane.py and tests/integration/rpc/test_lane_*.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.rpc.lane.client import AsyncLaneTransport, LaneTransport
from kvmesh.rpc.lane.server import LaneServer, servicer_methods
from tests.support.harness import ServerThread, server_thread

GATEWAY = "/kvmesh.gateway.v1.GatewayService/"
CHECK = "/grpc.health.v1.Health/Check"
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
HELLO = struct.Struct("<8sI")
REQUEST = struct.Struct("<IIIHH")
RESPONSE = struct.Struct("<IIB3x")


@contextlib.contextmanager
def socket_dir() -> Iterator[Path]:
    """A short directory for sockets (unix socket paths are limited to ~107 bytes)."""
    path = Path("/tmp") / f"kvmesh-lane-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("closed")
        data += chunk
    return data


def frame(
    call_id: int,
    method: str,
    payload: bytes,
    *,
    declared: int | None = None,
    timeout_ms: int = 0,
) -> bytes:
    m = method.encode()
    size = len(payload) if declared is None else declared
    return REQUEST.pack(size, call_id, timeout_ms, len(m), 0) + m + payload


def read_reply(sock: socket.socket) -> tuple[int, int, bytes]:
    size, call_id, code = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
    return call_id, code, recv_exact(sock, size)


class SlowHealth(health_pb2_grpc.HealthServicer):
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


def health_lane(path: Path, servicer: Any, max_message_bytes: int = 1 << 20) -> LaneServer:
    """A lane serving ``servicer`` as grpc.health.v1.Health (Check; Watch streams)."""
    return LaneServer(
        str(path), servicer_methods(HEALTH, servicer), max_message_bytes=max_message_bytes
    )


def check(
    lane: LaneTransport, delay_ms: int, timeout: float | None = 10.0, wait_for_ready: bool = False
) -> Any:
    request = health_pb2.HealthCheckRequest(service=str(delay_ms)).SerializeToString()
    body = lane.call(CHECK, request, timeout, wait_for_ready)
    return health_pb2.HealthCheckResponse.FromString(body)


async def acheck(
    lane: AsyncLaneTransport, delay_ms: int, timeout: float | None = 10.0, **kwargs: Any
) -> Any:
    request = health_pb2.HealthCheckRequest(service=str(delay_ms)).SerializeToString()
    body = await lane.call(CHECK, request, timeout, **kwargs)
    return health_pb2.HealthCheckResponse.FromString(body)


@contextlib.contextmanager
def running_slow_lane(directory: Path) -> Iterator[tuple[ServerThread, LaneServer, SlowHealth]]:
    """A lane serving :class:`SlowHealth`, started on a server thread."""
    servicer = SlowHealth()
    lane = health_lane(directory / "slow.sock", servicer)
    with server_thread() as thread:
        thread.run(lane.start())
        try:
            yield thread, lane, servicer
        finally:
            thread.run(lane.stop(0.5))
