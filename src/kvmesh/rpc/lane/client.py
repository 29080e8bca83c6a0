"""The lane's client side: the typed clients' transports for ``lane:<path>`` targets.

:class:`LaneTransport` is the blocking one (one call per connection at a
time, a pool of connections, safe across threads and ``fork()``);
:class:`AsyncLaneTransport` the asyncio one (every call pipelined on one
connection), for a service calling another on the same host — a gateway
calling its storage node. Both take the method path and the serialized
request and return the serialized response, or raise
:class:`~kvmesh.rpc.errors.RpcError` like the gRPC transports do: the
server's status, UNAVAILABLE when no lane server answers (or the connection
is lost mid-call), DEADLINE_EXCEEDED when the call's time runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import grpc

from kvmesh.common.telemetry import current_traceparent, tracing_enabled
from kvmesh.rpc.errors import RpcError
from kvmesh.rpc.lane.framing import (
    HELLO,
    RESPONSE,
    cancel_frame,
    read_hello,
    reply_result,
    request_frame,
)
from kvmesh.rpc.lane.gilsocket import recv_some, send_now

_RECV_BYTES = 1 << 16
_CONNECT_RETRY_S = 0.05


def _unavailable(path: str, why: object) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, f"local lane {path}: {why}")


def _deadline_exceeded() -> RpcError:
    return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise _deadline_exceeded()
    return left


def _check_size(payload: bytes, limit: int) -> None:
    if len(payload) > limit:
        raise RpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request of {len(payload)} bytes exceeds the server's max_message_bytes {limit}",
        )


def _may_retry_connect(exc: RpcError, deadline: float | None, wait_for_ready: bool) -> None:
    """Return if a failed connect should be tried again after a pause; raise otherwise."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or not wait_for_ready:
        raise exc
    if deadline is not None and time.monotonic() + _CONNECT_RETRY_S >= deadline:
        raise RpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"Deadline Exceeded ({exc.details()})"
        ) from None


class _TransportBase:
    """What both lane transports share: the target, method names, the client span."""

    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError("a lane target needs a socket path: lane:/path/to/socket")
        self.path = path
        # Decided once, as create_channel decides on the gRPC tracing interceptor.
        self.traced = tracing_enabled()
        self._methods: dict[str, bytes] = {}

    def _method(self, method: str) -> bytes:
        encoded = self._methods.get(method)
        if encoded is None:
            encoded = self._methods[method] = method.encode("ascii")
        return encoded

    @contextlib.contextmanager
    def _span(self, method: str) -> Iterator[bytes]:
        """The call's traceparent, inside a CLIENT span (tracing is on when this is used)."""
        from opentelemetry import trace

        # Named as the gRPC instrumentation names its spans: /package.Service/Method.
        name = method if method.startswith("/") else "/" + method
        service, _, rpc = name[1:].rpartition("/")
        tracer = trace.get_tracer("kvmesh.lane")
        with tracer.start_as_current_span(
            name,
            kind=trace.SpanKind.CLIENT,
            attributes={"rpc.system": "kvmesh-lane", "rpc.service": service, "rpc.method": rpc},
        ):
            yield current_traceparent().encode("ascii")


# -- blocking ----------------------------------------------------------------------------


class _Connection:
    """One socket to the lane server; one call at a time."""

    def __init__(self, sock: socket.socket, max_message_bytes: int) -> None:
        self.sock = sock
        self.max_message_bytes = max_message_bytes
        self.next_call_id = 1
        self.buffer = bytearray(_RECV_BYTES)

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


def _read_answer(
    conn: _Connection, deadline: float | None, spin_s: float
) -> tuple[int, int, bytes, bool]:
    """One answer: (call id, status code, body, whether more bytes followed it)."""
    fd = conn.sock.fileno()
    head = conn.buffer
    got = 0
    while got < RESPONSE.size:
        n = recv_some(fd, head, got, deadline, spin_s)
        if n == 0:
            raise ConnectionResetError("the server closed the connection")
        got += n
        spin_s = 0.0
    body_len, call_id, code = RESPONSE.unpack_from(head)
    have = got - RESPONSE.size
    if have >= body_len:
        end = RESPONSE.size + body_len
        return call_id, code, bytes(head[RESPONSE.size : end]), have > body_len
    body = bytearray(body_len)
    body[:have] = head[RESPONSE.size : got]
    while have < body_len:
        n = recv_some(fd, body, have, deadline)
        if n == 0:
            raise ConnectionResetError("the server closed the connection")
        have += n
    return call_id, code, bytes(body), False


class LaneTransport(_TransportBase):
    """Blocking unary calls over a lane.

    Thread-safe: each call takes an idle connection (or opens one) and gives
    it back when the answer is in. A connection that failed or timed out is
    closed, never reused (the server then cancels the call). After
    ``fork()`` the child opens its own.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self._spin_s: dict[bytes, float] = {}

    def wait_holding_gil(self, method: str, seconds: float) -> None:
        """Wait up to ``seconds`` for ``method``'s answers without releasing the GIL.

        For a short call whose caller holds others up while it waits (vLLM's
        scheduler waiting for a lookup): when the answer arrives, the caller
        goes on at once instead of first waiting for whichever of its
        process's threads took the GIL meanwhile. Past ``seconds`` the wait
        releases the GIL as every other call's does.
        """
        self._spin_s[self._method(method)] = seconds

    def call(
        self, method: str, request: bytes, timeout: float | None, wait_for_ready: bool = False
    ) -> bytes:
        """One round trip: the response bytes, or RpcError."""
        if self.traced:
            with self._span(method) as traceparent:
                return self._call(
                    self._method(method), request, timeout, traceparent, wait_for_ready
                )
        return self._call(self._method(method), request, timeout, b"", wait_for_ready)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> LaneTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            except RpcError as exc:
                _may_retry_connect(exc, deadline, wait_for_ready)
            time.sleep(_CONNECT_RETRY_S)

    def _connect(self, deadline: float | None) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(self.path)
            max_message_bytes = read_hello(self.path, _recv_exact(sock, HELLO.size))
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

    def _call(
        self,
        method: bytes,
        payload: bytes,
        timeout: float | None,
        traceparent: bytes,
        wait_for_ready: bool,
    ) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = self._acquire(deadline, wait_for_ready)
        try:
            _check_size(payload, conn.max_message_bytes)
            _remaining(deadline)
        except RpcError:
            self._release(conn)
            raise
        call_id = conn.next_call_id
        conn.next_call_id = (call_id + 1) & 0xFFFFFFFF
        sock = conn.sock
        try:
            frame = request_frame(call_id, method, traceparent, payload, timeout)
            # The request leaves with the GIL held; only the wait releases it (gilsocket).
            sent = send_now(sock.fileno(), frame)
            if sent < len(frame):  # the socket's buffer is full: wait for room as usual
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("timed out")  # a partial frame: the connection goes
                sock.settimeout(left)
                sock.sendall(memoryview(frame)[sent:])
            answered, code, body, extra = _read_answer(
                conn, deadline, self._spin_s.get(method, 0.0)
            )
        except TimeoutError:
            conn.close()
            raise _deadline_exceeded() from None
        except OSError as exc:
            conn.close()
            raise _unavailable(self.path, f"connection lost: {exc.strerror or exc}") from None
        if answered != call_id or extra:
            conn.close()
            raise RpcError(grpc.StatusCode.INTERNAL, "local lane: out-of-step response")
        self._release(conn)
        return reply_result(code, body)


# -- asyncio -----------------------------------------------------------------------------


class _AsyncConnection:
    """One connection of an AsyncLaneTransport: every call pipelined, answers by call id."""

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

    def start(
        self, method: bytes, traceparent: bytes, payload: bytes, timeout: float | None
    ) -> int:
        """Send one request; its call id (the answer arrives through ``answer(call_id)``)."""
        call_id = self._next_id
        self._next_id = (call_id % 0xFFFFFFFF) + 1
        self._pending[call_id] = asyncio.get_running_loop().create_future()
        self._writer.write(request_frame(call_id, method, traceparent, payload, timeout))
        return call_id

    async def drain(self) -> None:
        await self._writer.drain()

    def answer(self, call_id: int) -> asyncio.Future[tuple[int, bytes]]:
        return self._pending[call_id]

    def cancel(self, call_id: int) -> None:
        """Forget the call and ask the server to cancel it."""
        self._pending.pop(call_id, None)
        if self.alive and not self._writer.is_closing():
            self._writer.write(cancel_frame(call_id))

    async def _read_answers(self) -> None:
        why = "the server closed the connection"
        try:
            while True:
                head = await self._reader.readexactly(RESPONSE.size)
                size, call_id, code = RESPONSE.unpack(head)
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


class AsyncLaneTransport(_TransportBase):
    """Asyncio unary calls over a lane.

    Calls share one connection (pipelined, paired by call id); a call whose
    deadline passes or whose caller is cancelled is cancelled on the server.
    A lost connection fails the calls in flight with UNAVAILABLE and the next
    call opens a new one. Use it from one event loop.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._conn: _AsyncConnection | None = None
        self._connecting: asyncio.Lock | None = None
        self._closed = False

    async def call(
        self, method: str, request: bytes, timeout: float | None, wait_for_ready: bool = False
    ) -> bytes:
        """One call: the response bytes, or RpcError."""
        if self.traced:
            with self._span(method) as traceparent:
                return await self._call(
                    self._method(method), request, timeout, traceparent, wait_for_ready
                )
        return await self._call(self._method(method), request, timeout, b"", wait_for_ready)

    async def wait_ready(self) -> None:
        """Wait until a connection is open."""
        await self._connection(None, wait_for_ready=True)

    async def close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def __aenter__(self) -> AsyncLaneTransport:
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
                except RpcError as exc:
                    _may_retry_connect(exc, deadline, wait_for_ready)
                await asyncio.sleep(_CONNECT_RETRY_S)

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        reader, writer = await asyncio.open_unix_connection(self.path)
        try:
            return reader, writer, await reader.readexactly(HELLO.size)
        except BaseException:
            writer.close()
            raise

    async def _connect(self, deadline: float | None) -> _AsyncConnection:
        # wait_for, not asyncio.timeout: a lane handler may call this before its
        # first suspension, when it has no task yet (see lane/server.py).
        try:
            reader, writer, data = await asyncio.wait_for(self._open(), _remaining(deadline))
        except TimeoutError:
            raise _deadline_exceeded() from None
        except asyncio.IncompleteReadError:
            raise _unavailable(self.path, "the server closed the connection") from None
        except OSError as exc:
            raise _unavailable(self.path, exc.strerror or exc) from None
        try:
            max_message_bytes = read_hello(self.path, data)
        except RpcError:
            writer.close()
            raise
        return _AsyncConnection(self.path, reader, writer, max_message_bytes)

    async def _call(
        self,
        method: bytes,
        payload: bytes,
        timeout: float | None,
        traceparent: bytes,
        wait_for_ready: bool,
    ) -> bytes:
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
        return reply_result(code, body)
