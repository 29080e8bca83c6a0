"""The P2P data plane's wire format, and its asking side (a blocking reader).

One TCP connection carries one lease's chunks (the format is written down at
the top of ``protos/kvmesh/storage/v1/peer.proto``): the asking node sends
``KVMR`` and the lease id; the peer answers with a ``KVMC`` record per chunk
(a 16-byte header, then the chunk's bytes) and one ``KVME`` record with a
status. The reader receives every chunk with ``recv_into`` straight into the
memory its :class:`~kvmesh.storage.core.peer.ports.FrameSink` places it in
(the staged L1 object), so the bytes are copied once, by the kernel, as a
plain socket copy would; the server side is :mod:`kvmesh.storage.peers.dataplane`.
"""

from __future__ import annotations

import socket
import struct
import time

import grpc

from kvmesh.storage.core.peer.ports import FrameSink, PeerUnavailable

VERSION = 1
REQUEST_MAGIC = b"KVMR"
CHUNK_MAGIC = b"KVMC"
END_MAGIC = b"KVME"
#: magic, version, length of the lease id (which follows).
REQUEST = struct.Struct("<4sHH")
#: magic, chunk index or status code, body length (which follows).
RECORD = struct.Struct("<4sIQ")
MAX_LEASE_ID_BYTES = 256
MAX_MESSAGE_BYTES = 4096

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StreamRefused(PeerUnavailable):
    """The peer answered an end record with an error before sending any chunk."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def encode_request(lease_id: str) -> bytes:
    """What the asking node sends first."""
    raw = lease_id.encode()
    if not 0 < len(raw) <= MAX_LEASE_ID_BYTES:
        raise ValueError(f"a lease id is 1 to {MAX_LEASE_ID_BYTES} bytes")
    return REQUEST.pack(REQUEST_MAGIC, VERSION, len(raw)) + raw


def chunk_header(index: int, nbytes: int) -> bytes:
    """The header of chunk ``index`` (its ``nbytes`` bytes follow)."""
    return RECORD.pack(CHUNK_MAGIC, index, nbytes)


def end_record(code: grpc.StatusCode, message: str = "") -> bytes:
    """The record that ends a stream: a status and its message."""
    raw = message.encode()[:MAX_MESSAGE_BYTES]
    return RECORD.pack(END_MAGIC, code.value[0], len(raw)) + raw


def status_name(number: int) -> str:
    """The name of a status code number (``"CODE_<n>"`` for an unknown one)."""
    code = _CODES.get(number)
    return code.name if code is not None else f"CODE_{number}"


def receive(sock: socket.socket, lease_id: str, sink: FrameSink, deadline: float) -> bool:
    """Ask for a lease's chunks on a connected socket and receive them into ``sink``.

    True when the peer ended the stream with OK; False when the sink stopped
    it (the caller closes the socket, which ends the lease on the peer).
    Raises PeerUnavailable when the peer refused, broke off or was too slow
    for ``deadline`` (a ``time.monotonic()``); StreamRefused, a subclass, when
    it refused before sending anything.
    """
    _send(sock, encode_request(lease_id), deadline)
    chunks = 0
    header = bytearray(RECORD.size)
    header_view = memoryview(header)
    while True:
        _recv_exact(sock, header_view, deadline)
        magic, number, nbytes = RECORD.unpack(header)
        if magic == END_MAGIC:
            if nbytes > MAX_MESSAGE_BYTES:
                raise PeerUnavailable(f"the peer's end record says {nbytes} bytes of message")
            message = bytearray(nbytes)
            _recv_exact(sock, memoryview(message), deadline)
            if number == 0:
                return True
            text = message.decode(errors="replace")
            if chunks == 0:
                raise StreamRefused(status_name(number), text)
            raise PeerUnavailable(f"{status_name(number)}: {text}")
        if magic != CHUNK_MAGIC:
            raise PeerUnavailable(f"the peer sent a record {bytes(magic)!r}, not a chunk")
        view = sink.place(number, 0, nbytes)
        if view is None:
            return False
        chunks += 1
        got = 0
        while got < nbytes:
            n = _recv_into(sock, view[got:], deadline)
            sink.wrote(number, n)
            got += n


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerUnavailable("DEADLINE_EXCEEDED: the stream took longer than the load timeout")
    return left


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    try:
        sock.sendall(data)
    except OSError as exc:  # socket.timeout included
        raise PeerUnavailable(f"sending the request failed: {exc or type(exc).__name__}") from None


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> int:
    sock.settimeout(_left(deadline))
    try:
        n = sock.recv_into(view)
    except TimeoutError:
        raise PeerUnavailable(
            "DEADLINE_EXCEEDED: the stream took longer than the load timeout"
        ) from None
    except OSError as exc:
        raise PeerUnavailable(f"the stream broke: {exc or type(exc).__name__}") from None
    if n == 0:
        raise PeerUnavailable("the peer closed the stream before its end record")
    return n


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        got += _recv_into(sock, view[got:], deadline)
