"""PeerDataPlane on a real socket, with leases as a recording double.

What the integration tests cannot reach quickly: a connection that never sends
its request, more streams than the node serves, a shutdown in the middle of a
blocked send, and a lease deadline that passes while the sender is blocked.
Each checks the stream's memory is handed back (``close_stream``) only after
its sender stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvmesh.common.errors import NotFound
from kvmesh.storage.core.peer.leases import ChunkStream
from kvmesh.storage.peers import dataplane
from kvmesh.storage.peers import tcp_stream as wire
from kvmesh.storage.peers.dataplane import PeerDataPlane

BIG = 64 * 1024 * 1024  # far more than loopback's socket buffers


class Leases:
    def __init__(self, size: int = 1000, ttl_s: float = 30.0) -> None:
        self.memory = memoryview(bytearray(size))
        self.ttl_s = ttl_s
        self.opened: list[str] = []
        self.closed: list[tuple[str, int, int]] = []

    def open_stream(self, lease_id: str) -> ChunkStream:
        if not lease_id.startswith("lease"):
            raise NotFound(f"lease {lease_id!r} is unknown")
        self.opened.append(lease_id)
        return ChunkStream(lease_id, [self.memory], time.monotonic() + self.ttl_s)

    def close_stream(self, stream: ChunkStream, chunks: int, nbytes: int) -> None:
        self.closed.append((stream.lease_id, chunks, nbytes))


def run(leases: Leases, body: Callable[[PeerDataPlane], Awaitable[Any]], **kw: Any) -> Any:
    async def main() -> Any:
        plane = PeerDataPlane(leases, "127.0.0.1", 0, **kw)  # type: ignore[arg-type]
        await plane.start()
        try:
            return await body(plane)
        finally:
            await plane.close()

    return asyncio.run(main())


async def connect(plane: PeerDataPlane) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", plane.port))
    sock.setblocking(False)
    return sock


async def read_until_closed(sock: socket.socket, limit: int = 1 << 30) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while len(out) < limit:
        part = await loop.sock_recv(sock, 1 << 20)
        if not part:
            break
        out += part
    return bytes(out)


def end_of(raw: bytes) -> tuple[str, str]:
    magic, number, size = wire.RECORD.unpack_from(raw, 0)
    assert magic == wire.END_MAGIC, raw[:32]
    return wire.status_name(number), raw[wire.RECORD.size : wire.RECORD.size + size].decode()


def test_a_connection_that_sends_no_request_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataplane, "REQUEST_TIMEOUT_S", 0.2)
    leases = Leases()

    async def body(plane: PeerDataPlane) -> tuple[str, str]:
        sock = await connect(plane)
        with sock:
            return end_of(await read_until_closed(sock))

    code, message = run(leases, body)
    assert code == "INVALID_ARGUMENT"
    assert "no request" in message
    assert leases.opened == []


def test_a_lease_the_leases_do_not_know_is_not_found() -> None:
    leases = Leases()

    async def body(plane: PeerDataPlane) -> tuple[str, str]:
        sock = await connect(plane)
        with sock:
            await asyncio.get_running_loop().sock_sendall(sock, wire.encode_request("nope"))
            return end_of(await read_until_closed(sock))

    assert run(leases, body)[0] == "NOT_FOUND"
    assert leases.closed == []


def test_streams_beyond_the_limit_are_refused_and_the_running_one_goes_on() -> None:
    leases = Leases(size=BIG)

    async def body(plane: PeerDataPlane) -> tuple[str, str]:
        loop = asyncio.get_running_loop()
        first = await connect(plane)  # its sender blocks: nobody reads
        await loop.sock_sendall(first, wire.encode_request("lease-1"))
        while plane.streams == 0:
            await asyncio.sleep(0.01)
        second = await connect(plane)
        with first, second:
            await loop.sock_sendall(second, wire.encode_request("lease-2"))
            refused = end_of(await read_until_closed(second))
            got = await read_until_closed(first, limit=wire.RECORD.size + BIG)
            assert len(got) >= wire.RECORD.size + BIG
        return refused

    code, message = run(leases, body, max_streams=1)
    assert code == "RESOURCE_EXHAUSTED"
    assert "1 streams at once" in message
    assert leases.opened == ["lease-1"]


def ordered(monkeypatch: pytest.MonkeyPatch, leases: Leases) -> list[str]:
    """Events "sent" (a sender thread returned) and "closed" (the memory was handed back)."""
    events: list[str] = []
    send = PeerDataPlane._send

    def recorded(self: PeerDataPlane, conn: socket.socket, stream: ChunkStream) -> Any:
        try:
            return send(self, conn, stream)
        finally:
            events.append("sent")

    monkeypatch.setattr(PeerDataPlane, "_send", recorded)
    close = leases.close_stream

    def closing(stream: ChunkStream, chunks: int, nbytes: int) -> None:
        events.append("closed")
        close(stream, chunks, nbytes)

    leases.close_stream = closing  # type: ignore[method-assign]
    return events


async def blocked_stream(plane: PeerDataPlane) -> socket.socket:
    sock = await connect(plane)
    await asyncio.get_running_loop().sock_sendall(sock, wire.encode_request("lease-1"))
    while plane.streams == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # the sender is blocked in sendall now
    return sock


def test_close_breaks_a_blocked_send_before_the_memory_is_handed_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leases = Leases(size=BIG)
    events = ordered(monkeypatch, leases)
    sock = run(leases, blocked_stream)  # closes the plane with the stream running
    with sock:
        assert events == ["sent", "closed"]
        assert leases.closed == [("lease-1", 0, 0)]  # handed back, nothing sent whole


def test_a_stream_cancelled_twice_still_waits_for_its_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leases = Leases(size=BIG)
    events = ordered(monkeypatch, leases)

    async def body(plane: PeerDataPlane) -> None:
        sock = await blocked_stream(plane)
        with sock:
            (task,) = plane._handlers
            task.cancel()
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert events == ["sent", "closed"]

    run(leases, body)


def test_a_deadline_that_passes_mid_send_cuts_the_stream() -> None:
    leases = Leases(size=BIG, ttl_s=2.0)

    async def body(plane: PeerDataPlane) -> None:
        sock = await connect(plane)
        with sock:
            await asyncio.get_running_loop().sock_sendall(sock, wire.encode_request("lease-1"))
            while not leases.closed:
                await asyncio.sleep(0.05)  # not reading: the sender waits for the deadline
            raw = await read_until_closed(sock)
        magic, _, size = wire.RECORD.unpack_from(raw)
        assert magic == wire.CHUNK_MAGIC
        assert size == BIG
        assert len(raw) < wire.RECORD.size + BIG  # cut: no whole chunk, no end record

    run(leases, body)
    assert leases.closed == [("lease-1", 0, 0)]
