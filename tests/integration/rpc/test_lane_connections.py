"""The lane's connections over real unix sockets: deadlines, ordering, threads, fork, stop.

Against a lane serving a slow Health servicer (its Check sleeps for the
milliseconds named in the request), driven by the blocking
:class:`LaneTransport` or raw frames.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2

from kvmesh.rpc.errors import RpcError
from kvmesh.rpc.lane.client import LaneTransport
from kvmesh.rpc.lane.server import LaneServer
from tests.integration.rpc.lane_support import (
    CHECK,
    HELLO,
    SlowHealth,
    check,
    frame,
    health_lane,
    read_reply,
    recv_exact,
)
from tests.support.harness import ServerThread, server_thread
from tests.support.waiting import wait_until


def test_a_passed_deadline_is_deadline_exceeded_and_cancels_the_handler(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    _, lane, servicer = slow_lane
    channel = LaneTransport(str(lane.path))
    try:
        with pytest.raises(grpc.RpcError) as err:
            check(channel, 5000, timeout=0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The client dropped the connection; the server cancelled the call.
        assert servicer.cancelled.wait(5)
        assert "5000" not in servicer.finished
        assert check(channel, 0).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


def test_the_server_enforces_the_deadline_the_client_sent(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    _, lane, servicer = slow_lane
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(lane.path))
        recv_exact(sock, HELLO.size)
        slow = health_pb2.HealthCheckRequest(service="5000").SerializeToString()
        # A raw client that never gives up by itself: only the server's timer can end the call.
        sock.sendall(frame(1, CHECK, slow, timeout_ms=100))
        call_id, code, body = read_reply(sock)
        assert (call_id, code) == (1, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
        assert status_pb2.Status.FromString(body).code == code
        assert servicer.cancelled.wait(5)
        # The connection goes on; a call with time to spare is answered.
        quick = health_pb2.HealthCheckRequest(service="0").SerializeToString()
        sock.sendall(frame(2, CHECK, quick, timeout_ms=10_000))
        assert read_reply(sock)[:2] == (2, 0)
    assert "5000" not in servicer.finished


def test_calls_on_one_connection_are_answered_out_of_order_by_call_id(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    _, lane, _ = slow_lane
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(lane.path))
        recv_exact(sock, HELLO.size)
        slow = health_pb2.HealthCheckRequest(service="300").SerializeToString()
        fast = health_pb2.HealthCheckRequest(service="0").SerializeToString()
        sock.sendall(frame(1, CHECK, slow) + frame(2, CHECK, fast))
        first, second = read_reply(sock), read_reply(sock)
    assert (first[0], first[1]) == (2, 0)
    assert (second[0], second[1]) == (1, 0)


def test_threads_share_one_channel(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    _, lane, servicer = slow_lane
    channel = LaneTransport(str(lane.path))
    failures: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(25):
                assert check(channel, 1).status == health_pb2.HealthCheckResponse.SERVING
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
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    _, lane, _ = slow_lane
    channel = LaneTransport(str(lane.path))
    try:
        check(channel, 0)  # the parent now holds an idle connection
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            try:
                ok = all(check(channel, 0).status == 1 for _ in range(20))
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        for _ in range(20):
            assert check(channel, 0).status == health_pb2.HealthCheckResponse.SERVING
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        channel.close()


def test_no_server_is_unavailable_and_wait_for_ready_waits_for_one(sock_dir: Path) -> None:
    path = sock_dir / "later.sock"
    channel = LaneTransport(str(path))
    try:
        with pytest.raises(RpcError) as err:
            check(channel, 0, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(RpcError) as err:
            check(channel, 0, timeout=0.3, wait_for_ready=True)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        lane = health_lane(path, SlowHealth())
        with server_thread() as thread:
            result: list[Any] = []
            waiter = threading.Thread(
                target=lambda: result.append(check(channel, 0, timeout=10, wait_for_ready=True))
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
    channel = LaneTransport(str(path))
    try:
        with pytest.raises(RpcError) as err:
            check(channel, 0, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "lane version 1" in err.value.details()
    finally:
        channel.close()
        server.join(5)
        listener.close()


def test_stop_lets_a_call_in_flight_finish(sock_dir: Path) -> None:
    servicer = SlowHealth()
    lane = health_lane(sock_dir / "g.sock", servicer, max_message_bytes=4096)
    channel = LaneTransport(str(lane.path))
    with server_thread() as thread:
        thread.run(lane.start())
        result: list[Any] = []
        caller = threading.Thread(target=lambda: result.append(check(channel, 300)))
        caller.start()
        wait_until(lambda: bool(lane.connections))
        time.sleep(0.05)
        thread.run(lane.stop(5.0))
        caller.join(10)
    channel.close()
    assert result
    assert result[0].status == health_pb2.HealthCheckResponse.SERVING
    assert not lane.path.exists()
