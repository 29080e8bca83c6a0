"""How the blocking lane client reads answers: held-GIL waits, answers of any size.

Against real lane servers on unix sockets: the slow Health servicer of
tests/integration/rpc/lane_support.py, and a method that answers with as
many bytes as asked.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import wrappers_pb2
from grpc_health.v1 import health_pb2

from kvmesh.rpc.errors import RpcError
from kvmesh.rpc.lane.client import LaneTransport
from kvmesh.rpc.lane.framing import hello
from kvmesh.rpc.lane.server import LaneMethod, LaneServer
from tests.integration.rpc.lane_support import (
    CHECK,
    SlowHealth,
    check,
)
from tests.support.harness import ServerThread, server_thread

SERVING = health_pb2.HealthCheckResponse.SERVING
BYTES = "/test.Bytes/Get"


@pytest.mark.parametrize("delay_ms", [0, 300])
def test_a_held_wait_gets_answers_within_and_past_its_spin(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth], delay_ms: int
) -> None:
    _, lane, _ = slow_lane
    with LaneTransport(str(lane.path)) as channel:
        channel.wait_holding_gil(CHECK, 0.05)
        for _ in range(3):
            assert check(channel, delay_ms).status == SERVING


def test_a_held_wait_ends_at_the_calls_deadline(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    _, lane, servicer = slow_lane
    with LaneTransport(str(lane.path)) as channel:
        channel.wait_holding_gil(CHECK, 30.0)
        with pytest.raises(grpc.RpcError) as err:
            check(channel, 5000, timeout=0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert servicer.cancelled.wait(5)
        assert check(channel, 0).status == SERVING  # a new connection


def test_a_held_wait_leaves_other_threads_running(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    """A spin far longer than the answer takes: a Python thread beside it still gets the GIL."""
    _, lane, _ = slow_lane
    done = threading.Event()

    def work() -> None:
        total = 0
        for i in range(50_000):
            total += i
        done.set()

    with LaneTransport(str(lane.path)) as channel:
        channel.wait_holding_gil(CHECK, 30.0)
        worker = threading.Thread(target=work)
        worker.start()
        try:
            assert check(channel, 1000).status == SERVING
            # Finished while the call spun: the spin hands the GIL over at switch intervals.
            assert done.is_set()
        finally:
            worker.join(30)


def _bytes_lane(path: Path) -> LaneServer:
    async def get(request: Any, context: Any) -> wrappers_pb2.BytesValue:
        pattern = bytes(range(251))
        return wrappers_pb2.BytesValue(
            value=(pattern * (request.value // 251 + 1))[: request.value]
        )

    method = LaneMethod(BYTES, "Get", get, wrappers_pb2.Int64Value, wrappers_pb2.BytesValue)
    return LaneServer(str(path), {BYTES: method}, max_message_bytes=64 << 20)


@pytest.mark.parametrize("size", [0, 1, 65_000, 65_536 * 3 + 7, 20 << 20])
def test_answers_of_any_size_arrive_whole(sock_dir: Path, size: int) -> None:
    server = _bytes_lane(sock_dir / "bytes.sock")
    pattern = bytes(range(251))
    with server_thread() as thread:
        thread.run(server.start())
        try:
            with LaneTransport(str(server.path)) as channel:
                for _ in range(2):  # the second on the same connection
                    body = channel.call(
                        BYTES, wrappers_pb2.Int64Value(value=size).SerializeToString(), 30.0
                    )
                    value = wrappers_pb2.BytesValue.FromString(body).value
                    assert value == (pattern * (size // 251 + 1))[:size]
        finally:
            thread.run(server.stop(0.5))


@pytest.mark.parametrize("size", [100, 8 << 20])
def test_a_server_that_never_reads_nor_answers_ends_in_deadline_exceeded(
    sock_dir: Path, size: int
) -> None:
    """A request that fits the socket's buffer, and one that does not (sent partly, then waits)."""
    path = sock_dir / "deaf.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    accepted: list[socket.socket] = []

    def greet_then_ignore() -> None:
        conn, _ = listener.accept()
        conn.sendall(hello(64 << 20))
        accepted.append(conn)  # never read, never answered

    server = threading.Thread(target=greet_then_ignore)
    server.start()
    try:
        with LaneTransport(str(path)) as channel, pytest.raises(RpcError) as err:
            channel.call(BYTES, b"x" * size, 0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        server.join(5)
        for conn in accepted:
            conn.close()
        listener.close()
