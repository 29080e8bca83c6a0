"""The lane's server side: dispatch from the service descriptors, deadlines, connections.

A :class:`LaneServer` holds a table of :class:`LaneMethod` — full method
path → the servicer's handler and the request and response message classes,
all taken from the service's descriptor (:func:`unary_methods`). A call
parses its request with that class (bytes that do not parse are
INVALID_ARGUMENT, reason ``MALFORMED_REQUEST``, as on gRPC), runs the
handler with a small servicer context, maps an exception to its status with
the code gRPC uses (``error_status`` in src/kvmesh/rpc/interceptors.py),
counts it in the server's RPC metrics and answers.

The deadline the client sent is enforced here: a call still running when it
passes is cancelled (as a gRPC call's handler is) and answered
DEADLINE_EXCEEDED. A client that gives up earlier closes its connection
(blocking client) or sends a cancel frame (asyncio client), which cancels
the call too.

No gRPC server machinery is involved: no handler objects, no interceptors,
no gRPC exceptions — only ``grpc.StatusCode``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2

from kvmesh.common.config import ConfigError
from kvmesh.common.deadlines import CALL_DEADLINE
from kvmesh.common.errors import ERROR_DOMAIN
from kvmesh.common.telemetry import context_from_traceparent, tracing_enabled
from kvmesh.rpc.errors import STATUS_DETAILS_KEY, status_bytes
from kvmesh.rpc.handlers import malformed_request
from kvmesh.rpc.interceptors import error_status
from kvmesh.rpc.lane.eager import start_eagerly
from kvmesh.rpc.lane.framing import (
    TARGET_PREFIX,
    FrameError,
    RequestFrame,
    RequestReader,
    hello,
    response_header,
)

if TYPE_CHECKING:
    from kvmesh.rpc.metrics import RpcMetrics

logger = logging.getLogger(__name__)

#: Calls one connection may have in flight before the server stops reading it.
MAX_IN_FLIGHT_PER_CONNECTION = 64
#: The ErrorInfo reason of a frame the server cannot use.
MALFORMED_FRAME = "MALFORMED_FRAME"
_WRITE_AT_ONCE_BYTES = 1 << 16


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


# -- the method table --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LaneMethod:
    """One unary method: its servicer handler and message classes, from the descriptor."""

    path: str
    #: The RPC's short name (the label of its metrics).
    name: str
    handler: Callable[[Any, Any], Any]
    request_type: type[Message]
    response_type: type[Message]


def unary_methods(
    service: ServiceDescriptor, handler: Callable[[str], Callable[[Any, Any], Any] | None]
) -> dict[str, LaneMethod]:
    """The lane's table for ``service``: each unary method that ``handler(name)`` serves.

    Streaming methods are left out (the lane serves unary calls only).
    """
    table: dict[str, LaneMethod] = {}
    for method in service.methods:
        if method.client_streaming or method.server_streaming:
            continue
        found = handler(method.name)
        if found is None:
            continue
        path = f"/{service.full_name}/{method.name}"
        table[path] = LaneMethod(
            path,
            method.name,
            found,
            message_factory.GetMessageClass(method.input_type),
            message_factory.GetMessageClass(method.output_type),
        )
    return table


def servicer_methods(service: ServiceDescriptor, servicer: object) -> dict[str, LaneMethod]:
    """The lane's table for ``service`` served by ``servicer``'s methods of the RPCs' names."""
    return unary_methods(service, lambda name: getattr(servicer, name, None))


# -- one call ----------------------------------------------------------------------------


class LaneAbort(Exception):
    """Raised by :meth:`LaneContext.abort`; the lane answers with its status."""

    def __init__(self, code: grpc.StatusCode, details: str, status: bytes) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.status = status


class LaneContext:
    """The part of ``grpc.aio.ServicerContext`` kvmesh's servicers use, for one lane call."""

    def __init__(
        self, peer: str, metadata: tuple[tuple[str, str], ...], deadline: float | None
    ) -> None:
        self._peer = peer
        self._metadata = metadata
        self._deadline = deadline
        self._code: grpc.StatusCode | None = None
        self._details = ""

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, Any]] = (),
    ) -> None:
        status = next(
            (v for k, v in trailing_metadata if k == STATUS_DETAILS_KEY and isinstance(v, bytes)),
            b"",
        )
        raise LaneAbort(code, details or code.name, status)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def details(self) -> str:
        return self._details

    def set_details(self, details: str) -> None:
        self._details = details

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


def _error_body(code: grpc.StatusCode, message: str, reason: str | None = None) -> bytes:
    info = None
    if reason is not None:
        info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN)
    return status_bytes(code, message, info)


@contextlib.contextmanager
def _server_span(method: str, traceparent: str) -> Iterator[None]:
    """A SERVER span for the call (the OTel gRPC interceptor's stand-in on the lane).

    Named as gRPC's: ``/package.Service/Method`` (``method`` is the full path).
    """
    from opentelemetry import trace

    service, _, name = method.lstrip("/").rpartition("/")
    tracer = trace.get_tracer("kvmesh.lane")
    with tracer.start_as_current_span(
        "/" + method.lstrip("/"),
        context=context_from_traceparent(traceparent),
        kind=trace.SpanKind.SERVER,
        attributes={"rpc.system": "kvmesh-lane", "rpc.service": service, "rpc.method": name},
    ):
        yield


# -- the server --------------------------------------------------------------------------


class LaneServer:
    """Serves a table of unary methods on a unix socket."""

    def __init__(
        self,
        path: str,
        methods: Mapping[str, LaneMethod],
        *,
        metrics: RpcMetrics | None = None,
        max_message_bytes: int,
    ) -> None:
        self.path = Path(path)
        self.target = TARGET_PREFIX + str(self.path)
        self.methods = dict(methods)
        self.max_message_bytes = max_message_bytes
        self._metrics = metrics
        self.connections: set[_LaneConnection] = set()
        self._listener: socket.socket | None = None
        self._server: asyncio.AbstractServer | None = None
        self.hello = hello(max_message_bytes)
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
        pending = [task for conn in self.connections for task in conn.tasks]
        if pending:
            await asyncio.wait(pending, timeout=grace)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
        self._server = None
        self._listener = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def invoke(
        self, method: str, deadline: float | None, traceparent: str, payload: bytes, peer: str
    ) -> tuple[int, bytes]:
        """Run one call; (status code, response bytes or serialized Status)."""
        entry = self.methods.get(method)
        if entry is None:
            code = grpc.StatusCode.UNIMPLEMENTED
            return code.value[0], _error_body(
                code,
                f"method {method} is not served on the local lane (streaming RPCs and "
                "unknown methods need gRPC)",
            )
        start = time.perf_counter()
        outcome = "OK"
        try:
            code, body = await self._run(entry, deadline, traceparent, payload, peer)
            outcome = code.name
        except asyncio.CancelledError:
            late = deadline is not None and time.monotonic() >= deadline
            outcome = "DEADLINE_EXCEEDED" if late else "CANCELLED"
            raise
        finally:
            if self._metrics is not None:
                self._metrics.observe(entry.name, outcome, time.perf_counter() - start)
        return code.value[0], body

    async def _run(
        self, entry: LaneMethod, deadline: float | None, traceparent: str, payload: bytes, peer: str
    ) -> tuple[grpc.StatusCode, bytes]:
        try:
            try:
                request = entry.request_type.FromString(payload)
            except DecodeError as exc:
                raise malformed_request(entry.path, exc) from None
            metadata = (("traceparent", traceparent),) if traceparent else ()
            context = LaneContext(peer, metadata, deadline)
            CALL_DEADLINE.set(deadline)
            if self._traced:
                with _server_span(entry.path, traceparent):
                    response = entry.handler(request, context)
                    if inspect.isawaitable(response):
                        response = await response
            else:
                # Servicer methods are coroutines; a plain function's value is taken as is.
                response = entry.handler(request, context)
                if inspect.isawaitable(response):
                    response = await response
            if type(response) is not entry.response_type:
                raise TypeError(
                    f"{entry.path} returned {type(response).__name__}, "
                    f"not {entry.response_type.__name__}"
                )
            return grpc.StatusCode.OK, response.SerializeToString()
        except LaneAbort as abort:
            return abort.code, abort.status or _error_body(abort.code, abort.details)
        except Exception as exc:
            code, message, status = error_status(exc, entry.path)
            return code, status or _error_body(code, message)


class _LaneConnection(asyncio.Protocol):
    """One client connection: parses request frames, runs each call, enforces deadlines."""

    def __init__(self, lane: LaneServer) -> None:
        self.lane = lane
        self.tasks: set[asyncio.Task[None]] = set()
        self._by_call: dict[int, asyncio.Task[None]] = {}
        self._timers: dict[asyncio.Task[None], asyncio.TimerHandle] = {}
        self._expired: set[asyncio.Task[None]] = set()
        self._reader = RequestReader(lane.max_message_bytes)
        self._transport: asyncio.Transport | None = None
        self._paused = False
        self._closing = False
        self._peer = lane.target

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)
        self.lane.connections.add(self)
        self._transport.write(self.lane.hello)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.lane.connections.discard(self)
        if self._reader.pending:
            logger.debug("lane %s: connection closed inside a frame", self._peer)
        # Like a cancelled gRPC call: handlers shield what must finish (storage calls).
        for task in self.tasks:
            task.cancel()

    def close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        for item in self._reader.feed(data):
            if self._closing:
                return
            if type(item) is RequestFrame:
                self._dispatch(item)
            else:
                self._refuse(cast(FrameError, item))

    def _refuse(self, error: FrameError) -> None:
        """Answer a frame the server cannot use; close when the stream is lost past it."""
        if error.fatal:
            logger.warning("lane %s: %s; closing the connection", self._peer, error.message)
        self._send(
            error.call_id,
            error.code.value[0],
            _error_body(error.code, error.message, MALFORMED_FRAME),
        )
        if error.fatal:
            self.close()

    def _dispatch(self, frame: RequestFrame) -> None:
        if not frame.method:  # a cancel frame
            running = self._by_call.get(frame.call_id)
            if running is not None:
                running.cancel()
            return
        deadline = None
        if frame.timeout_ms:
            deadline = time.monotonic() + frame.timeout_ms / 1000.0
        task = start_eagerly(self._call(frame, deadline))
        if task is None:  # answered already
            return
        self.tasks.add(task)
        self._by_call[frame.call_id] = task
        task.add_done_callback(functools.partial(self._done, frame.call_id))
        if deadline is not None:
            loop = asyncio.get_running_loop()
            left = max(0.0, deadline - time.monotonic())
            self._timers[task] = loop.call_later(left, self._expire, task)
        if len(self.tasks) >= MAX_IN_FLIGHT_PER_CONNECTION and not self._paused:
            assert self._transport is not None
            self._transport.pause_reading()
            self._paused = True

    def _expire(self, task: asyncio.Task[None]) -> None:
        """The call's deadline passed: cancel its handler; it answers DEADLINE_EXCEEDED."""
        self._timers.pop(task, None)
        if not task.done():
            self._expired.add(task)
            task.cancel()

    def _done(self, call_id: int, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._expired.discard(task)
        timer = self._timers.pop(task, None)
        if timer is not None:
            timer.cancel()
        if self._by_call.get(call_id) is task:
            del self._by_call[call_id]
        if self._paused and len(self.tasks) < MAX_IN_FLIGHT_PER_CONNECTION // 2:
            self._paused = False
            if self._transport is not None and not self._closing:
                self._transport.resume_reading()

    async def _call(self, frame: RequestFrame, deadline: float | None) -> None:
        try:
            code, body = await self.lane.invoke(
                frame.method, deadline, frame.traceparent, frame.payload, self._peer
            )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task not in self._expired:
                raise
            # Cancelled by its deadline: the caller hears so (when it still listens).
            exceeded = grpc.StatusCode.DEADLINE_EXCEEDED
            code, body = exceeded.value[0], _error_body(exceeded, "Deadline Exceeded")
        except Exception as exc:  # a bug in the lane itself; the caller still gets an answer
            logger.error("lane call %s failed", frame.method, exc_info=exc)
            internal = grpc.StatusCode.INTERNAL
            code, body = (
                internal.value[0],
                _error_body(internal, f"internal error in {frame.method}"),
            )
        self._send(frame.call_id, code, body)

    def _send(self, call_id: int, code: int, body: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        header = response_header(call_id, code, len(body))
        if len(body) < _WRITE_AT_ONCE_BYTES:
            self._transport.write(header + body)
        else:
            self._transport.writelines((header, body))
