"""The local lane: a service's unary RPCs as framed Protobuf over a unix socket.

Why it exists: on the small hosts kvmesh is measured on, one Python gRPC
round trip costs 0.6–0.9 ms even for an empty message (gRPC core hands each
call between its own threads and the Python one), while a plain unix-socket
round trip costs about 0.04 ms. An engine asks its node's gateway for a
lookup on every scheduled request, so that hop is the one that matters; the
lane serves it without gRPC's thread hand-offs.

It changes the transport only, never the contract: the lane carries the
exact request and response messages of the service's ``.proto``, runs the
same servicer behind the same error-mapping and metrics interceptor, and
answers with the same status codes and ``google.rpc.Status`` details
(ErrorInfo included). On the client side :class:`LaneChannel` stands in for
a ``grpc.Channel``, so the generated stubs and the typed clients — their
deadlines and their retry policy — work over it unchanged: dial
``lane:<path>`` instead of ``host:port``. Streaming RPCs are not served on
the lane (UNIMPLEMENTED); use gRPC for those.

Wire format, version 1 (integers little-endian):

- on connect the server sends ``b"KVMLANE1"`` and ``u32 max_message_bytes``;
- request: ``u32 payload_len, u32 call_id, u32 timeout_ms (0 = none),
  u16 method_len, u16 traceparent_len``, then the full method path
  (``/kvmesh.gateway.v1.GatewayService/Lookup``, ASCII), the W3C
  traceparent (ASCII, may be empty) and the serialized request;
- response: ``u32 payload_len, u32 call_id, u8 code, 3 bytes padding``,
  then the serialized response when ``code`` is 0 (OK), otherwise a
  serialized ``google.rpc.Status`` whose code equals ``code``.

Calls on one connection may be answered out of order; ``call_id`` pairs
them. A request frame with an empty method and payload cancels the call
with that ``call_id`` (an asyncio client whose deadline passed; a blocking
client closes its connection instead) and is not answered. A frame the
server cannot parse, or one over ``max_message_bytes``, closes the
connection after an error reply where one can be addressed.

:class:`LaneChannel` is the blocking client (one call per connection at a
time, a pool of connections); :class:`AsyncLaneChannel` the asyncio one
(every call pipelined on one connection), for a service calling another on
the same host — a gateway calling its storage node.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from kvmesh.common.config import ConfigError
from kvmesh.common.telemetry import (
    context_from_traceparent,
    current_traceparent,
    tracing_enabled,
)
from kvmesh.rpc.interceptors import STATUS_DETAILS_KEY

logger = logging.getLogger(__name__)

TARGET_PREFIX = "lane:"
MAGIC = b"KVMLANE1"
_HELLO = struct.Struct("<8sI")
_REQUEST = struct.Struct("<IIIHH")
_RESPONSE = struct.Struct("<IIB3x")
_OK = 0
_CODES = {code.value[0]: code for code in grpc.StatusCode}
#: Calls one connection may have in flight before the server stops reading it.
MAX_IN_FLIGHT_PER_CONNECTION = 64
_RECV_BYTES = 1 << 16
_CONNECT_RETRY_S = 0.05


def lane_path(target: str) -> str | None:
    """The socket path of a ``lane:<path>`` target, None for any other target."""
    if not target.startswith(TARGET_PREFIX):
        return None
    return target[len(TARGET_PREFIX) :]


def claim_unix_socket(path: Path) -> None:
    """Make ``path`` free to bind: remove a stale socket, refuse a live one or a file.

    A server killed with SIGKILL leaves its socket file behind; binding over
    it needs the file gone, but a socket some server still answers on must
    not be stolen. Raises ConfigError with the reason.
    """
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_socket():
        raise ConfigError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nothing listens: a stale socket
            return
    raise ConfigError(f"cannot listen on unix:{path}: a server is using it")


def _status_bytes(code: grpc.StatusCode, message: str) -> bytes:
    status = status_pb2.Status(code=code.value[0], message=message)
    data: bytes = status.SerializeToString()
    return data


# -- server ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Method:
    """A resolved unary method: the interceptor-wrapped behaviour and its codecs."""

    behaviour: Callable[[Any, Any], Awaitable[Any]]
    deserialize: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = method
        self.invocation_metadata = metadata


class HandlerCollector:
    """Stands in for a grpc server to collect a binding's method handlers.

    ``add_*Servicer_to_server`` functions register their handlers both ways
    (generic and per method); both are kept so that either kind resolves.
    """

    def __init__(self) -> None:
        self.registered: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        for name, handler in handlers.items():
            self.registered[f"/{service}/{name}"] = handler

    def find(self, method: str) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self.registered.get(method)
        if handler is not None:
            return handler
        details = _CallDetails(method, ())
        for generic in self.generic:
            found = generic.service(details)
            if found is not None:
                return found
        return None


class _LaneContext:
    """The part of ``grpc.aio.ServicerContext`` kvmesh's servicers and interceptor use."""

    def __init__(self, peer: str, metadata: tuple[tuple[str, str], ...], deadline: float | None):
        self._peer = peer
        self._metadata = metadata
        self._deadline = deadline
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: tuple[tuple[str, Any], ...] = ()

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._code = code
        self._details = details
        self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def details(self) -> str:
        return self._details

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False

    def error_status(self) -> tuple[int, bytes]:
        """(code, serialized google.rpc.Status) of an aborted call."""
        code = self._code or grpc.StatusCode.UNKNOWN
        for key, value in self._trailing:
            if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
                return code.value[0], value
        return code.value[0], _status_bytes(code, self._details or code.name)


Interceptor = Callable[
    [Callable[[grpc.HandlerCallDetails], Awaitable[Any]], grpc.HandlerCallDetails],
    Awaitable[Any],
]


class LaneServer:
    """Serves the unary methods a :class:`HandlerCollector` holds on a unix socket."""

    def __init__(
        self,
        path: str,
        handlers: HandlerCollector,
        *,
        intercept: Interceptor | None,
        max_message_bytes: int,
    ) -> None:
        self.path = Path(path)
        self.target = TARGET_PREFIX + str(self.path)
        self._handlers = handlers
        self._intercept = intercept
        self._max_message_bytes = max_message_bytes
        self._methods: dict[str, _Method] = {}
        self._connections: set[_LaneConnection] = set()
        self._listener: socket.socket | None = None
        self._server: asyncio.AbstractServer | None = None
        self._hello = _HELLO.pack(MAGIC, max_message_bytes)
        # Decided once, as create_server decides on the gRPC tracing interceptor.
        self._traced = tracing_enabled()

    def bind(self) -> None:
        """Claim and bind the socket (ConfigError when it cannot); serving starts in start()."""
        claim_unix_socket(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise ConfigError(f"cannot listen on {self.target}: {exc.strerror or exc}") from exc
        listener.setblocking(False)
        self._listener = listener

    async def start(self) -> None:
        if self._listener is None:
            self.bind()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _LaneConnection(self), sock=self._listener
        )

    async def stop(self, grace: float) -> None:
        """Refuse new connections, let calls in flight finish within ``grace``, close."""
        if self._server is not None:
            self._server.close()
        elif self._listener is not None:
            self._listener.close()
        pending = [task for conn in self._connections for task in conn.tasks]
        if pending:
            await asyncio.wait(pending, timeout=grace)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
        self._server = None
        self._listener = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _resolve(self, method: str) -> _Method | None:
        resolved = self._methods.get(method)
        if resolved is not None:
            return resolved
        handler: Any = self._handlers.find(method)
        if handler is not None and handler.unary_unary is not None:
            if self._intercept is not None:

                async def continuation(_: grpc.HandlerCallDetails) -> Any:
                    return handler

                handler = await self._intercept(continuation, _CallDetails(method, ()))
            resolved = _Method(
                handler.unary_unary, handler.request_deserializer, handler.response_serializer
            )
            # Only served methods are remembered: made-up names must not grow the table.
            self._methods[method] = resolved
        return resolved

    async def invoke(
        self, method: str, timeout_ms: int, traceparent: str, payload: bytes, peer: str
    ) -> tuple[int, bytes]:
        """Run one call; (status code, response bytes or serialized Status)."""
        entry = self._methods.get(method) or await self._resolve(method)
        if entry is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], _status_bytes(
                grpc.StatusCode.UNIMPLEMENTED,
                f"method {method} is not served on the local lane (streaming RPCs and "
                "unknown methods need gRPC)",
            )
        try:
            request = entry.deserialize(payload)
        except DecodeError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], _status_bytes(
                grpc.StatusCode.INVALID_ARGUMENT, f"request of {method} does not parse: {exc}"
            )
        metadata: tuple[tuple[str, str], ...] = ()
        if traceparent:
            metadata = (("traceparent", traceparent),)
        deadline = time.monotonic() + timeout_ms / 1000.0 if timeout_ms else None
        context = _LaneContext(peer, metadata, deadline)
        # No timer per call: a client whose deadline passes closes its connection
        # (blocking client) or sends a cancel frame (asyncio client), and that
        # cancels the call, as a cancelled gRPC call is.
        try:
            if self._traced:
                with _server_span(method, traceparent):
                    response = await entry.behaviour(request, context)
            else:
                response = await entry.behaviour(request, context)
        except grpc.aio.AbortError:
            return context.error_status()
        return _OK, entry.serialize(response)


@contextlib.contextmanager
def _server_span(method: str, traceparent: str) -> Iterator[None]:
    """A SERVER span for the call (the OTel gRPC interceptor's stand-in on the lane)."""
    from opentelemetry import trace

    service, _, name = method.lstrip("/").rpartition("/")
    tracer = trace.get_tracer("kvmesh.lane")
    with tracer.start_as_current_span(
        method.lstrip("/"),
        context=context_from_traceparent(traceparent),
        kind=trace.SpanKind.SERVER,
        attributes={"rpc.system": "kvmesh-lane", "rpc.service": service, "rpc.method": name},
    ):
        yield


class _Started:
    """Awaiting it drives a coroutine that has run its first step and yielded ``pending``.

    The rest of :func:`_start_eagerly`: what ``yield from`` would do for a
    coroutine that is already running. The task that awaits this sees each
    future the coroutine waits on, and every value or exception the task
    delivers (cancellation included) goes on to the coroutine.
    """

    def __init__(self, coro: Coroutine[Any, Any, None], pending: object) -> None:
        self._coro = coro
        self._pending = pending

    def __await__(self) -> Generator[object, None, None]:
        coro, pending = self._coro, self._pending
        while True:
            try:
                yield pending
            except GeneratorExit:  # the awaiting task is being closed: close the call too
                coro.close()
                raise
            except BaseException as exc:
                try:
                    pending = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    pending = coro.send(None)
                except StopIteration:
                    return


async def _finish(started: _Started) -> None:
    await started


def _start_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run ``coro`` now, up to its first suspension; a task for the rest, None if it finished.

    Most lane calls never wait (an all-L1 lookup on ``kvmesh node``, an
    EndSession, a Ping): run at once, they skip a task and an event-loop turn
    each (~40 µs here), which is what Python 3.12's eager tasks do. The call
    runs in a context of its own, and the task that finishes a suspended one
    keeps that same context, so context variables (tracing spans) set before
    the suspension are reset in the context that set them. Until the first
    suspension ``asyncio.current_task()`` is None; lane handlers do not use it.
    """
    context = contextvars.copy_context()
    try:
        pending = context.run(coro.send, None)
    except StopIteration:
        return None
    loop = asyncio.get_running_loop()
    return loop.create_task(_finish(_Started(coro, pending)), context=context)


class _LaneConnection(asyncio.Protocol):
    """One client connection: parses request frames, runs each call as a task."""

    def __init__(self, lane: LaneServer) -> None:
        self.lane = lane
        self.tasks: set[asyncio.Task[None]] = set()
        self._by_call: dict[int, asyncio.Task[None]] = {}
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._paused = False
        self._closing = False
        self._peer = lane.target

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)
        self.lane._connections.add(self)
        self._transport.write(self.lane._hello)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.lane._connections.discard(self)
        # Like a cancelled gRPC call: handlers shield what must finish (storage calls).
        for task in self.tasks:
            task.cancel()

    def close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._buffer:
            self._buffer += data
            view: bytes | bytearray = self._buffer
        else:
            view = data
        used = self._parse(view)
        if view is self._buffer:
            del self._buffer[:used]
        elif used < len(data):
            self._buffer += data[used:]

    def _parse(self, data: bytes | bytearray) -> int:
        """Dispatch every complete frame in ``data``; bytes consumed."""
        pos = 0
        size = len(data)
        header = _REQUEST.size
        limit = self.lane._max_message_bytes
        while not self._closing and size - pos >= header:
            payload_len, call_id, timeout_ms, method_len, tp_len = _REQUEST.unpack_from(data, pos)
            if payload_len > limit:
                self._send(
                    call_id,
                    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                    _status_bytes(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"request of {payload_len} bytes exceeds max_message_bytes {limit}",
                    ),
                )
                self.close()
                return size
            end = pos + header + method_len + tp_len + payload_len
            if end > size:
                break
            start = pos + header
            try:
                method = bytes(data[start : start + method_len]).decode("ascii")
                traceparent = bytes(data[start + method_len : start + method_len + tp_len]).decode(
                    "ascii"
                )
            except UnicodeDecodeError:
                logger.warning("lane %s: a frame with a non-ASCII method; closing", self._peer)
                self.close()
                return size
            payload = bytes(data[start + method_len + tp_len : end])
            pos = end
            if not method and not payload:
                running = self._by_call.get(call_id)
                if running is not None:
                    running.cancel()
                continue
            task = _start_eagerly(self._call(call_id, method, timeout_ms, traceparent, payload))
            if task is None:  # answered already
                continue
            self.tasks.add(task)
            self._by_call[call_id] = task
            task.add_done_callback(functools.partial(self._done, call_id))
            if len(self.tasks) >= MAX_IN_FLIGHT_PER_CONNECTION and not self._paused:
                assert self._transport is not None
                self._transport.pause_reading()
                self._paused = True
        return pos

    def _done(self, call_id: int, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if self._by_call.get(call_id) is task:
            del self._by_call[call_id]
        if self._paused and len(self.tasks) < MAX_IN_FLIGHT_PER_CONNECTION // 2:
            self._paused = False
            if self._transport is not None and not self._closing:
                self._transport.resume_reading()

    async def _call(
        self, call_id: int, method: str, timeout_ms: int, traceparent: str, payload: bytes
    ) -> None:
        try:
            code, body = await self.lane.invoke(
                method, timeout_ms, traceparent, payload, self._peer
            )
        except Exception as exc:  # a bug in the lane itself; the caller still gets an answer
            logger.error("lane call %s failed", method, exc_info=exc)
            code = grpc.StatusCode.INTERNAL.value[0]
            body = _status_bytes(grpc.StatusCode.INTERNAL, f"internal error in {method}")
        self._send(call_id, code, body)

    def _send(self, call_id: int, code: int, body: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        header = _RESPONSE.pack(len(body), call_id, code)
        if len(body) < _RECV_BYTES:
            self._transport.write(header + body)
        else:
            self._transport.writelines((header, body))


# -- client ------------------------------------------------------------------------------


class LaneRpcError(grpc.RpcError, grpc.Call):
    """A failed lane call, shaped like the error of a failed gRPC call."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, Any], ...] = ()
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing = trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing

    def initial_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def __str__(self) -> str:
        return f"<LaneRpcError {self._code.name}: {self._details}>"


def _unavailable(path: str, why: object) -> LaneRpcError:
    return LaneRpcError(grpc.StatusCode.UNAVAILABLE, f"local lane {path}: {why}")


def _deadline_exceeded() -> LaneRpcError:
    return LaneRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def _max_message_bytes(path: str, hello: bytes) -> int:
    """The server's limit from its hello; UNAVAILABLE when the socket speaks something else."""
    magic, max_message_bytes = _HELLO.unpack(hello)
    if magic != MAGIC:
        raise _unavailable(path, "the socket does not speak kvmesh lane version 1")
    return int(max_message_bytes)


def _check_size(payload: bytes, limit: int) -> None:
    if len(payload) > limit:
        raise LaneRpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request of {len(payload)} bytes exceeds the server's max_message_bytes {limit}",
        )


def _request_frame(
    call_id: int, method: bytes, traceparent: str, payload: bytes, timeout: float | None
) -> bytes:
    tp = traceparent.encode("ascii")
    timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000))
    header = _REQUEST.pack(len(payload), call_id, timeout_ms, len(method), len(tp))
    return b"".join((header, method, tp, payload))


def _result(code: int, body: bytes) -> bytes:
    """The response bytes of an answered call, or its error as LaneRpcError."""
    if code == _OK:
        return body
    status = status_pb2.Status.FromString(body)
    trailing = ((STATUS_DETAILS_KEY, body),) if status.details else ()
    raise LaneRpcError(_CODES.get(code, grpc.StatusCode.UNKNOWN), status.message, trailing)


def _may_retry_connect(exc: LaneRpcError, deadline: float | None, wait_for_ready: bool) -> None:
    """Return if a failed connect should be tried again after a pause; raise otherwise."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or not wait_for_ready:
        raise exc
    if deadline is not None and time.monotonic() + _CONNECT_RETRY_S >= deadline:
        raise LaneRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"Deadline Exceeded ({exc.details()})"
        ) from None


class _ChannelBase:
    """What both lane channels share: the target, tracing, and no streaming RPCs."""

    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError("a lane target needs a socket path: lane:/path/to/socket")
        self.path = path
        # Decided once, as create_channel decides on the gRPC tracing interceptor.
        self.traced = tracing_enabled()

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> _NotOnLane:
        return _NotOnLane(method)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> _NotOnLane:
        return _NotOnLane(method)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> _NotOnLane:
        return _NotOnLane(method)


class _MultiCallableBase:
    """What both lane multi-callables share: codecs, the trace context, the client span."""

    def __init__(
        self,
        traced: bool,
        method: str,
        serializer: Callable[[Any], bytes] | None,
        deserializer: Callable[[bytes], Any] | None,
    ) -> None:
        self._traced = traced
        self._method = method
        self._method_bytes = method.encode("ascii")
        self._serialize = serializer or (lambda message: message)
        self._deserialize = deserializer or (lambda data: data)

    @contextlib.contextmanager
    def _span(self, metadata: Sequence[tuple[str, str]] | None) -> Iterator[str]:
        """The call's traceparent, inside a CLIENT span when tracing is on."""
        traceparent = next((v for k, v in metadata or () if k == "traceparent"), "")
        if not self._traced:
            yield traceparent
            return
        from opentelemetry import trace

        tracer = trace.get_tracer("kvmesh.lane")
        with tracer.start_as_current_span(
            self._method.lstrip("/"),
            kind=trace.SpanKind.CLIENT,
            attributes={"rpc.system": "kvmesh-lane"},
        ):
            yield traceparent or current_traceparent()

    def _decode(self, body: bytes) -> Any:
        try:
            return self._deserialize(body)
        except DecodeError as exc:
            raise LaneRpcError(
                grpc.StatusCode.INTERNAL, f"response of {self._method} does not parse: {exc}"
            ) from None


class _Connection:
    """One socket to the lane server; one call at a time."""

    def __init__(self, sock: socket.socket, max_message_bytes: int) -> None:
        self.sock = sock
        self.max_message_bytes = max_message_bytes
        self.next_call_id = 1

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    if count == 0:
        return b""
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("the server closed the connection")
        got += n
    return bytes(buffer)


class LaneChannel(_ChannelBase):
    """A blocking ``grpc.Channel`` stand-in for ``lane:<path>`` targets.

    Thread-safe: each call takes an idle connection (or opens one) and gives
    it back when the answer is in. A connection that failed or timed out is
    closed, never reused. After ``fork()`` the child opens its own.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False

    # grpc.Channel's surface used by generated stubs -------------------------------------

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool = False,
    ) -> _LaneUnaryUnary:
        return _LaneUnaryUnary(self, method, request_serializer, response_deserializer)

    def subscribe(self, callback: Callable[..., None], try_to_connect: bool = False) -> None:
        """Connectivity callbacks are not tracked on the lane."""

    def unsubscribe(self, callback: Callable[..., None]) -> None:
        """Connectivity callbacks are not tracked on the lane."""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> LaneChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # connections ------------------------------------------------------------------------

    def _acquire(self, deadline: float | None, wait_for_ready: bool) -> _Connection:
        with self._lock:
            if self._closed:
                raise ValueError("Cannot invoke RPC on closed channel!")
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours
                self._idle = []
                self._pid = os.getpid()
            if self._idle:
                return self._idle.pop()
        while True:
            try:
                return self._connect(deadline)
            except LaneRpcError as exc:
                _may_retry_connect(exc, deadline, wait_for_ready)
            time.sleep(_CONNECT_RETRY_S)

    def _connect(self, deadline: float | None) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(self.path)
            hello = _recv_exact(sock, _HELLO.size)
            max_message_bytes = _max_message_bytes(self.path, hello)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise _deadline_exceeded() from None
            if isinstance(exc, OSError):
                raise _unavailable(self.path, exc.strerror or exc) from None
            raise
        return _Connection(sock, max_message_bytes)

    def _release(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and self._pid == os.getpid():
                self._idle.append(conn)
                return
        conn.close()

    def call(
        self,
        method: bytes,
        payload: bytes,
        timeout: float | None,
        traceparent: str,
        wait_for_ready: bool,
    ) -> bytes:
        """One round trip; the response bytes, or LaneRpcError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = self._acquire(deadline, wait_for_ready)
        try:
            _check_size(payload, conn.max_message_bytes)
        except LaneRpcError:
            self._release(conn)
            raise
        call_id = conn.next_call_id
        conn.next_call_id = (call_id + 1) & 0xFFFFFFFF
        sock = conn.sock
        try:
            sock.settimeout(_remaining(deadline))
            sock.sendall(_request_frame(call_id, method, traceparent, payload, timeout))
            head = sock.recv(_RECV_BYTES)
            while 0 < len(head) < _RESPONSE.size:
                head += sock.recv(_RECV_BYTES)
            if not head:
                raise ConnectionResetError("the server closed the connection")
            body_len, answered, code = _RESPONSE.unpack_from(head)
            body = head[_RESPONSE.size :]
            if len(body) < body_len:
                body += _recv_exact(sock, body_len - len(body))
        except TimeoutError:
            conn.close()
            raise _deadline_exceeded() from None
        except OSError as exc:
            conn.close()
            raise _unavailable(self.path, f"connection lost: {exc.strerror or exc}") from None
        if answered != call_id or len(body) != body_len:
            conn.close()
            raise LaneRpcError(grpc.StatusCode.INTERNAL, "local lane: out-of-step response")
        self._release(conn)
        return _result(code, body)


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise _deadline_exceeded()
    return left


class _LaneUnaryUnary(_MultiCallableBase):
    """``grpc.UnaryUnaryMultiCallable`` over a lane."""

    def __init__(
        self,
        channel: LaneChannel,
        method: str,
        serializer: Callable[[Any], bytes] | None,
        deserializer: Callable[[bytes], Any] | None,
    ) -> None:
        super().__init__(channel.traced, method, serializer, deserializer)
        self._channel = channel

    def __call__(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        with self._span(metadata) as traceparent:
            payload = self._serialize(request)
            body = self._channel.call(
                self._method_bytes, payload, timeout, traceparent, bool(wait_for_ready)
            )
            return self._decode(body)

    def with_call(self, *args: Any, **kwargs: Any) -> tuple[Any, LaneRpcError | None]:
        return self(*args, **kwargs), None


class _NotOnLane:
    """A streaming method: the lane serves unary calls only."""

    def __init__(self, method: str) -> None:
        self._method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise LaneRpcError(
            grpc.StatusCode.UNIMPLEMENTED,
            f"{self._method} is a streaming RPC; the local lane serves unary RPCs only",
        )


# -- asyncio client ----------------------------------------------------------------------


def _aio_error(error: LaneRpcError) -> grpc.aio.AioRpcError:
    """The error an asyncio gRPC call would raise, for callers catching AioRpcError."""
    return grpc.aio.AioRpcError(
        error.code(),
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*error.trailing_metadata()),
        error.details(),
        None,
    )


class _AsyncConnection:
    """One connection of an AsyncLaneChannel: every call pipelined, answers by call id."""

    def __init__(
        self,
        path: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        max_message_bytes: int,
    ) -> None:
        self.path = path
        self.max_message_bytes = max_message_bytes
        self.alive = True
        self._reader = reader
        self._writer = writer
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._next_id = 1
        self._reading = asyncio.get_running_loop().create_task(self._read_answers())

    def start(self, method: bytes, traceparent: str, payload: bytes, timeout: float | None) -> int:
        """Send one request; its call id (the answer arrives through ``answer(call_id)``)."""
        call_id = self._next_id
        self._next_id = (call_id % 0xFFFFFFFF) + 1
        self._pending[call_id] = asyncio.get_running_loop().create_future()
        self._writer.write(_request_frame(call_id, method, traceparent, payload, timeout))
        return call_id

    async def drain(self) -> None:
        await self._writer.drain()

    def answer(self, call_id: int) -> asyncio.Future[tuple[int, bytes]]:
        return self._pending[call_id]

    def cancel(self, call_id: int) -> None:
        """Forget the call and ask the server to cancel it."""
        self._pending.pop(call_id, None)
        if self.alive and not self._writer.is_closing():
            self._writer.write(_REQUEST.pack(0, call_id, 0, 0, 0))

    async def _read_answers(self) -> None:
        why = "the server closed the connection"
        try:
            while True:
                head = await self._reader.readexactly(_RESPONSE.size)
                size, call_id, code = _RESPONSE.unpack(head)
                body = await self._reader.readexactly(size) if size else b""
                waiter = self._pending.pop(call_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result((code, body))
        except asyncio.IncompleteReadError:
            pass
        except OSError as exc:
            why = f"connection lost: {exc.strerror or exc}"
        except asyncio.CancelledError:
            why = "the channel was closed"
        finally:
            self.alive = False
            pending, self._pending = self._pending, {}
            for waiter in pending.values():
                if not waiter.done():
                    waiter.set_exception(_unavailable(self.path, why))
            self._writer.close()

    async def close(self) -> None:
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading


class AsyncLaneChannel(_ChannelBase):
    """A ``grpc.aio.Channel`` stand-in for ``lane:<path>`` targets.

    Calls share one connection (pipelined, paired by call id); a call whose
    deadline passes or whose caller is cancelled is cancelled on the server.
    A lost connection fails the calls in flight with UNAVAILABLE and the next
    call opens a new one. Errors are ``grpc.aio.AioRpcError``, as from a gRPC
    channel. Use it from one event loop.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._conn: _AsyncConnection | None = None
        self._connecting: asyncio.Lock | None = None
        self._closed = False

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool = False,
    ) -> _AsyncLaneUnaryUnary:
        return _AsyncLaneUnaryUnary(self, method, request_serializer, response_deserializer)

    async def channel_ready(self) -> None:
        """Wait until a connection is open."""
        await self._connection(None, wait_for_ready=True)

    async def close(self, grace: float | None = None) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def __aenter__(self) -> AsyncLaneChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _connection(self, deadline: float | None, wait_for_ready: bool) -> _AsyncConnection:
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        if self._closed:
            raise ValueError("Cannot invoke RPC on closed channel!")
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            conn = self._conn
            if conn is not None and conn.alive:
                return conn
            while True:
                try:
                    self._conn = await self._connect(deadline)
                    return self._conn
                except LaneRpcError as exc:
                    _may_retry_connect(exc, deadline, wait_for_ready)
                await asyncio.sleep(_CONNECT_RETRY_S)

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        reader, writer = await asyncio.open_unix_connection(self.path)
        try:
            return reader, writer, await reader.readexactly(_HELLO.size)
        except BaseException:
            writer.close()
            raise

    async def _connect(self, deadline: float | None) -> _AsyncConnection:
        # wait_for, not asyncio.timeout: a lane handler may call this before its
        # first suspension, when it has no task yet (see _start_eagerly).
        try:
            reader, writer, hello = await asyncio.wait_for(self._open(), _remaining(deadline))
        except TimeoutError:
            raise _deadline_exceeded() from None
        except asyncio.IncompleteReadError:
            raise _unavailable(self.path, "the server closed the connection") from None
        except OSError as exc:
            raise _unavailable(self.path, exc.strerror or exc) from None
        try:
            max_message_bytes = _max_message_bytes(self.path, hello)
        except LaneRpcError:
            writer.close()
            raise
        return _AsyncConnection(self.path, reader, writer, max_message_bytes)

    async def call(
        self,
        method: bytes,
        payload: bytes,
        timeout: float | None,
        traceparent: str,
        wait_for_ready: bool,
    ) -> bytes:
        """One call; the response bytes, or LaneRpcError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = await self._connection(deadline, wait_for_ready)
        _check_size(payload, conn.max_message_bytes)
        left = _remaining(deadline)
        call_id = conn.start(method, traceparent, payload, timeout)
        try:
            if len(payload) >= _RECV_BYTES:
                await asyncio.wait_for(conn.drain(), left)
                if deadline is not None:
                    left = max(0.0, deadline - time.monotonic())
            code, body = await asyncio.wait_for(conn.answer(call_id), left)
        except TimeoutError:
            conn.cancel(call_id)
            raise _deadline_exceeded() from None
        except asyncio.CancelledError:
            conn.cancel(call_id)
            raise
        except OSError as exc:
            conn.cancel(call_id)
            raise _unavailable(self.path, f"connection lost: {exc.strerror or exc}") from None
        return _result(code, body)


class _AsyncLaneUnaryUnary(_MultiCallableBase):
    """``grpc.aio.UnaryUnaryMultiCallable`` over a lane."""

    def __init__(
        self,
        channel: AsyncLaneChannel,
        method: str,
        serializer: Callable[[Any], bytes] | None,
        deserializer: Callable[[bytes], Any] | None,
    ) -> None:
        super().__init__(channel.traced, method, serializer, deserializer)
        self._channel = channel

    async def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        try:
            with self._span(metadata) as traceparent:
                payload = self._serialize(request)
                body = await self._channel.call(
                    self._method_bytes, payload, timeout, traceparent, bool(wait_for_ready)
                )
                return self._decode(body)
        except LaneRpcError as exc:
            raise _aio_error(exc) from None
