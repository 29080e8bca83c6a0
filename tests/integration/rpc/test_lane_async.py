"""The lane's asyncio client and eager calls over real unix sockets.

A service calling another on its host (a gateway calling its storage node)
uses :class:`AsyncLaneTransport`: calls pipelined on one connection, paired
by call id, cancelled on the server when their deadline passes or their
caller is cancelled. And the server runs a call at once, up to its first
wait, each in a context of its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.rpc.errors import RpcError
from kvmesh.rpc.lane.client import AsyncLaneTransport
from kvmesh.rpc.lane.server import LaneServer
from tests.integration.rpc.lane_support import (
    CHECK,
    HELLO,
    SlowHealth,
    acheck,
    frame,
    health_lane,
    read_reply,
    recv_exact,
)
from tests.support.harness import ServerThread, server_thread

# -- the asyncio client (a service calling another on its host) ---------------------------


def test_async_calls_share_one_connection_and_are_paired_by_call_id(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    _, lane, servicer = slow_lane

    async def scenario() -> list[str]:
        async with AsyncLaneTransport(str(lane.path)) as channel:
            delays = [200, 0, 100, 0, 50]
            replies = await asyncio.gather(*(acheck(channel, d) for d in delays))
            assert all(r.status == health_pb2.HealthCheckResponse.SERVING for r in replies)
            assert len(lane.connections) == 1
            return list(servicer.finished)

    finished = asyncio.run(scenario())
    # Answered as they finished, not as they were sent.
    assert finished.index("0") < finished.index("50") < finished.index("100")
    assert finished.index("100") < finished.index("200")


def test_an_async_deadline_cancels_only_that_call_on_the_server(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    _, lane, servicer = slow_lane

    async def scenario() -> None:
        async with AsyncLaneTransport(str(lane.path)) as channel:
            survivor = asyncio.ensure_future(acheck(channel, 400))
            with pytest.raises(RpcError) as err:
                await acheck(channel, 5000, timeout=0.2)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await survivor).status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(scenario())
    assert servicer.cancelled.wait(5)
    assert "5000" not in servicer.finished
    assert "400" in servicer.finished


def test_a_cancelled_async_caller_cancels_its_call_on_the_server(
    slow_lane: tuple[ServerThread, LaneServer, SlowHealth],
) -> None:
    _, lane, servicer = slow_lane

    async def scenario() -> None:
        async with AsyncLaneTransport(str(lane.path)) as channel:
            call = asyncio.ensure_future(acheck(channel, 5000))
            await asyncio.sleep(0.2)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(scenario())
    assert servicer.cancelled.wait(5)


def test_async_calls_in_flight_fail_unavailable_when_the_server_goes(sock_dir: Path) -> None:
    lane = health_lane(sock_dir / "gone.sock", SlowHealth(), max_message_bytes=4096)
    with server_thread() as thread:
        thread.run(lane.start())

        async def scenario() -> None:
            async with AsyncLaneTransport(str(lane.path)) as channel:
                call = asyncio.ensure_future(acheck(channel, 5000))
                await asyncio.sleep(0.2)
                await asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(lane.stop(0.0), thread.loop)
                )
                with pytest.raises(RpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                with pytest.raises(RpcError) as err:
                    await acheck(channel, 0, timeout=2)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        asyncio.run(scenario())


def test_async_wait_for_ready_waits_for_the_server(sock_dir: Path) -> None:
    path = sock_dir / "late.sock"
    lane = health_lane(path, SlowHealth(), max_message_bytes=4096)
    with server_thread() as thread:

        async def scenario() -> None:
            async with AsyncLaneTransport(str(path)) as channel:
                with pytest.raises(RpcError) as err:
                    await acheck(channel, 0, timeout=2)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                waiting = asyncio.ensure_future(acheck(channel, 0, wait_for_ready=True))
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
    lane = health_lane(sock_dir / "ctx.sock", servicer, max_message_bytes=4096)
    method = CHECK
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
