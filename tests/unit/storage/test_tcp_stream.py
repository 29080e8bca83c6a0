"""The P2P data plane's reader against scripted peers: every bad stream ends cleanly.

Each test's peer is a thread on the other end of a real loopback socket that
sends exactly the bytes the test scripts (a peer that lies, breaks off or
stalls); the reader must never write outside what its sink placed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.storage.core.peer.ports import PeerUnavailable
from kvmesh.storage.peers import tcp_stream as wire


class Sink:
    """Chunks of ``size`` bytes; records what was placed and written."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self.memory = [bytearray(size) for _ in range(count)]
        self.received = [0] * count

    def place(self, index: int, offset: int, nbytes: int) -> memoryview | None:
        if not 0 <= index < len(self.memory) or offset != self.received[index]:
            return None
        if offset + nbytes > self.size:
            return None
        return memoryview(self.memory[index])[offset : offset + nbytes]

    def wrote(self, index: int, nbytes: int) -> None:
        self.received[index] += nbytes


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    server.close()
    try:
        yield client, peer
    finally:
        client.close()
        peer.close()


def script(peer: socket.socket, *parts: bytes, close: bool = True, hold: float = 0.0) -> None:
    """Read the request, then send ``parts`` (then hold the connection open, then close)."""

    def run() -> None:
        head = peer.recv(wire.REQUEST.size)
        _, _, size = wire.REQUEST.unpack(head)
        peer.recv(size)
        with contextlib.suppress(OSError):  # the reader may hang up first
            for part in parts:
                peer.sendall(part)
            time.sleep(hold)
            if close:
                peer.shutdown(socket.SHUT_RDWR)

    threading.Thread(target=run, daemon=True).start()


def chunk(index: int, body: bytes) -> bytes:
    return wire.chunk_header(index, len(body)) + body


def test_whole_chunks_then_ok_arrive_in_place(pair: tuple[socket.socket, socket.socket]) -> None:
    client, peer = pair
    script(peer, chunk(0, b"a" * 1000), chunk(1, b"b" * 1000), wire.end_record(grpc.StatusCode.OK))
    sink = Sink(2, 1000)
    assert wire.receive(client, "lease-1", sink, time.monotonic() + 5) is True
    assert sink.memory == [bytearray(b"a" * 1000), bytearray(b"b" * 1000)]
    assert sink.received == [1000, 1000]


def test_an_error_end_record_names_the_status(pair: tuple[socket.socket, socket.socket]) -> None:
    client, peer = pair
    script(peer, wire.end_record(grpc.StatusCode.NOT_FOUND, "lease 'x' is unknown"))
    with pytest.raises(wire.StreamRefused, match="NOT_FOUND: lease 'x' is unknown") as info:
        wire.receive(client, "x", Sink(1, 10), time.monotonic() + 5)
    assert info.value.code == "NOT_FOUND"  # refused before any chunk: the lease is intact


def test_an_error_after_a_chunk_is_a_broken_stream_not_a_refusal(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, peer = pair
    script(peer, chunk(0, b"a" * 10), wire.end_record(grpc.StatusCode.DEADLINE_EXCEEDED, "late"))
    with pytest.raises(PeerUnavailable, match="DEADLINE_EXCEEDED: late") as info:
        wire.receive(client, "x", Sink(2, 10), time.monotonic() + 5)
    assert not isinstance(info.value, wire.StreamRefused)


@pytest.mark.parametrize(
    ("name", "records"),
    [
        ("larger than the sink's chunk", [chunk(0, b"x" * 11)]),
        ("an index out of range", [chunk(5, b"x" * 10)]),
        ("a chunk sent twice", [chunk(0, b"x" * 10), chunk(0, b"y" * 10)]),
    ],
)
def test_a_chunk_the_sink_does_not_place_stops_the_stream_unwritten(
    pair: tuple[socket.socket, socket.socket], name: str, records: list[bytes]
) -> None:
    client, peer = pair
    script(peer, *records, close=False, hold=1.0)
    sink = Sink(1, 10)
    assert wire.receive(client, "lease", sink, time.monotonic() + 5) is False, name
    assert sink.received[0] in (0, 10)
    if sink.received[0] == 10:
        assert sink.memory[0] == bytearray(b"x" * 10)  # the first copy, never the second


def test_a_record_that_is_not_a_chunk_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    client, peer = pair
    script(peer, b"HTTP/1.1 200 OK\r\n\r\n" + b"\0" * 16)
    with pytest.raises(PeerUnavailable, match="not a chunk"):
        wire.receive(client, "lease", Sink(1, 10), time.monotonic() + 5)


def test_an_end_record_with_a_huge_message_is_refused(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, peer = pair
    script(peer, wire.RECORD.pack(wire.END_MAGIC, 0, 1 << 40))
    with pytest.raises(PeerUnavailable, match="bytes of message"):
        wire.receive(client, "lease", Sink(1, 10), time.monotonic() + 5)


def test_a_peer_that_closes_mid_chunk_leaves_the_chunk_short(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, peer = pair
    script(peer, chunk(0, b"a" * 100), wire.chunk_header(1, 100) + b"b" * 40)
    sink = Sink(2, 100)
    with pytest.raises(PeerUnavailable, match="before its end record"):
        wire.receive(client, "lease", sink, time.monotonic() + 5)
    assert sink.received == [100, 40]  # the fetcher keeps only chunk 0


def test_a_stalled_peer_fails_at_the_deadline(pair: tuple[socket.socket, socket.socket]) -> None:
    client, peer = pair
    script(peer, wire.chunk_header(0, 100) + b"a" * 10, close=False, hold=5.0)
    sink = Sink(1, 100)
    start = time.monotonic()
    with pytest.raises(PeerUnavailable, match="DEADLINE_EXCEEDED"):
        wire.receive(client, "lease", sink, start + 2.0)
    assert sink.received == [10]


def test_the_request_carries_the_lease_id(pair: tuple[socket.socket, socket.socket]) -> None:
    client, peer = pair
    client.sendall(wire.encode_request("lease-7-abc"))
    magic, version, size = wire.REQUEST.unpack(peer.recv(wire.REQUEST.size))
    assert (magic, version, peer.recv(size)) == (wire.REQUEST_MAGIC, 1, b"lease-7-abc")
    with pytest.raises(ValueError, match="1 to 256 bytes"):
        wire.encode_request("x" * 257)
    assert wire.status_name(5) == "NOT_FOUND"
    assert wire.status_name(99) == "CODE_99"
