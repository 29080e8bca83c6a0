"""The lane's wire format, version 1, and the parser of a request stream.

Integers are little-endian:

- on connect the server sends ``b"KVMLANE1"`` and ``u32 max_message_bytes``;
- request: ``u32 payload_len, u32 call_id, u32 timeout_ms (0 = none),
  u16 method_len, u16 traceparent_len``, then the full method path
  (``/kvmesh.gateway.v1.GatewayService/Lookup``, ASCII), the W3C
  traceparent (ASCII, may be empty) and the serialized request;
- response: ``u32 payload_len, u32 call_id, u8 code, 3 bytes padding``,
  then the serialized response when ``code`` is 0 (OK), otherwise a
  serialized ``google.rpc.Status`` whose code equals ``code``.

Calls on one connection may be answered out of order; ``call_id`` pairs
them. A request frame with no method, traceparent or payload cancels the
call with that ``call_id`` and is not answered. The server enforces
``timeout_ms``: a call still running when it passes is cancelled and
answered DEADLINE_EXCEEDED.

A frame that is whole but unusable (a method name that is not ASCII, a
payload without a method) is answered with INVALID_ARGUMENT and the
connection goes on. A frame whose header cannot be trusted — a payload over
``max_message_bytes``, a method or traceparent longer than any real one —
is answered (RESOURCE_EXHAUSTED / INVALID_ARGUMENT) and the connection is
closed, since the bytes after it cannot be delimited.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from kvmesh.rpc.errors import RpcError, status_code

TARGET_PREFIX = "lane:"
MAGIC = b"KVMLANE1"
HELLO = struct.Struct("<8sI")
REQUEST = struct.Struct("<IIIHH")
RESPONSE = struct.Struct("<IIB3x")
OK = 0
#: Longest method path and traceparent a request frame may carry (real ones are < 100 bytes).
MAX_METHOD_BYTES = 1024
MAX_TRACEPARENT_BYTES = 512


def lane_path(target: str) -> str | None:
    """The socket path of a ``lane:<path>`` target, None for any other target."""
    if not target.startswith(TARGET_PREFIX):
        return None
    return target[len(TARGET_PREFIX) :]


# -- frames ------------------------------------------------------------------------------


def hello(max_message_bytes: int) -> bytes:
    """What the server sends first on every connection."""
    return HELLO.pack(MAGIC, max_message_bytes)


def read_hello(path: str, data: bytes) -> int:
    """The server's max_message_bytes from its hello; UNAVAILABLE when it speaks something else."""
    magic, max_message_bytes = HELLO.unpack(data)
    if magic != MAGIC:
        raise RpcError(
            grpc.StatusCode.UNAVAILABLE,
            f"local lane {path}: the socket does not speak kvmesh lane version 1",
        )
    return int(max_message_bytes)


def request_frame(
    call_id: int, method: bytes, traceparent: bytes, payload: bytes, timeout: float | None
) -> bytes:
    """One request; ``timeout`` in seconds (None: no deadline)."""
    timeout_ms = 0 if timeout is None else min(0xFFFFFFFF, max(1, int(timeout * 1000)))
    header = REQUEST.pack(len(payload), call_id, timeout_ms, len(method), len(traceparent))
    return b"".join((header, method, traceparent, payload))


def cancel_frame(call_id: int) -> bytes:
    """Asks the server to cancel call ``call_id`` (never answered)."""
    return REQUEST.pack(0, call_id, 0, 0, 0)


def response_header(call_id: int, code: int, body_len: int) -> bytes:
    return RESPONSE.pack(body_len, call_id, code)


def reply_result(code: int, body: bytes) -> bytes:
    """The response bytes of an answered call; its error as :class:`RpcError` otherwise."""
    if code == OK:
        return body
    try:
        status = status_pb2.Status.FromString(body)
    except DecodeError:
        raise RpcError(
            grpc.StatusCode.INTERNAL, "local lane: an error reply that does not parse"
        ) from None
    raise RpcError(status_code(code), status.message, body if status.details else b"")


# -- the server's side: cutting frames out of a byte stream --------------------------------


@dataclass(frozen=True, slots=True)
class RequestFrame:
    """One parsed request; ``method`` empty means "cancel call ``call_id``"."""

    call_id: int
    timeout_ms: int
    method: str
    traceparent: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class FrameError:
    """A frame the server answers with an error instead of a call.

    ``fatal``: the stream cannot be delimited past it; the connection closes
    after the answer.
    """

    call_id: int
    code: grpc.StatusCode
    message: str
    fatal: bool


class RequestReader:
    """Cuts request frames out of whatever pieces the socket delivers.

    :meth:`feed` returns the frames completed so far, in order; an unusable
    frame appears among them as a :class:`FrameError`. After a fatal one the
    reader ignores everything else.
    """

    __slots__ = ("_broken", "_buffer", "_limit")

    def __init__(self, max_message_bytes: int) -> None:
        self._limit = max_message_bytes
        self._buffer = bytearray()
        self._broken = False

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[RequestFrame | FrameError]:
        if self._broken:
            return []
        view: bytes | bytearray
        if self._buffer:
            self._buffer += data
            view = self._buffer
        else:
            view = data
        out: list[RequestFrame | FrameError] = []
        used = self._parse(view, out)
        if self._broken:
            self._buffer.clear()
        elif view is self._buffer:
            del self._buffer[:used]
        elif used < len(data):
            self._buffer += data[used:]
        return out

    def _parse(self, data: bytes | bytearray, out: list[RequestFrame | FrameError]) -> int:
        pos = 0
        size = len(data)
        header = REQUEST.size
        while size - pos >= header:
            payload_len, call_id, timeout_ms, method_len, tp_len = REQUEST.unpack_from(data, pos)
            broken = _untrusted_header(payload_len, method_len, tp_len, self._limit)
            if broken is not None:
                code, message = broken
                out.append(FrameError(call_id, code, message, fatal=True))
                self._broken = True
                return size
            start = pos + header
            end = start + method_len + tp_len + payload_len
            if end > size:
                break
            pos = end
            try:
                method = data[start : start + method_len].decode("ascii")
                traceparent = data[start + method_len : start + method_len + tp_len].decode("ascii")
            except UnicodeDecodeError:
                out.append(
                    FrameError(
                        call_id,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "the frame's method name or traceparent is not ASCII",
                        fatal=False,
                    )
                )
                continue
            payload = bytes(data[start + method_len + tp_len : end])
            if not method and (payload or traceparent):
                out.append(
                    FrameError(
                        call_id,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "a frame with a payload names no method",
                        fatal=False,
                    )
                )
                continue
            out.append(RequestFrame(call_id, timeout_ms, method, traceparent, payload))
        return pos


def _untrusted_header(
    payload_len: int, method_len: int, tp_len: int, limit: int
) -> tuple[grpc.StatusCode, str] | None:
    """Why a frame header cannot be trusted (code, message), None when it can."""
    if payload_len > limit:
        return (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request of {payload_len} bytes exceeds max_message_bytes {limit}",
        )
    if method_len > MAX_METHOD_BYTES or tp_len > MAX_TRACEPARENT_BYTES:
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a frame header declares a {method_len}-byte method and a {tp_len}-byte "
            f"traceparent (at most {MAX_METHOD_BYTES} and {MAX_TRACEPARENT_BYTES})",
        )
    return None
