"""The server interceptor every kvmesh service runs: error mapping and RPC metrics.

Error mapping: a :class:`~kvmesh.common.errors.KvmeshError` raised by a
handler becomes its status code with the exception's message and a
``google.rpc.ErrorInfo`` detail (reason, domain, metadata such as the bad
field). Any other exception becomes INTERNAL with a message that carries the
trace id, and is logged with its traceback — the caller always gets an answer
(LMCache's "raise → no reply → client waits 300 s" cannot happen here).

A call this handler made to another kvmesh service that failed (the gateway
calling storage, say) is relayed with the downstream code, message and
ErrorInfo, so the engine sees "block id 9000 is out of range" rather than an
opaque INTERNAL.

Both jobs live in one interceptor because each interceptor layer costs a few
microseconds per call and lookups must stay well under a millisecond. The
mapping itself, :func:`error_status`, is shared with the local lane
(src/kvmesh/rpc/lane/server.py), which answers with the same statuses.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.rpc import error_details_pb2

from kvmesh.common.deadlines import CALL_DEADLINE, deadline_in
from kvmesh.common.errors import ERROR_DOMAIN, KvmeshError
from kvmesh.common.telemetry import current_trace_id
from kvmesh.rpc.errors import STATUS_DETAILS_KEY, error_info, status_bytes
from kvmesh.rpc.metrics import RpcMetrics

logger = logging.getLogger(__name__)

# Re-exported: tests and tools read a failed call's ErrorInfo through this module.
__all__ = [
    "STATUS_DETAILS_KEY",
    "ServiceInterceptor",
    "error_info",
    "error_status",
    "status_details",
]


def status_details(code: grpc.StatusCode, error: KvmeshError) -> bytes:
    """Serialized ``google.rpc.Status`` carrying an ErrorInfo for ``error``."""
    info = error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata
    )
    return status_bytes(code, error.message, info)


def _code_name(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    code = context.code()
    if code is None:
        return "OK"
    if isinstance(code, grpc.StatusCode):
        return code.name
    try:
        return grpc.StatusCode(code).name if not isinstance(code, int) else _INT_CODES[code]
    except (KeyError, ValueError):
        return "UNKNOWN"


_INT_CODES = {c.value[0]: c.name for c in grpc.StatusCode}


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes and records per-method metrics."""

    def __init__(self, metrics: RpcMetrics | None) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: Any = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        full = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method, full),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, method, full),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method, full),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(handler.stream_stream, method, full),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _record(self, method: str, context: Any, code: str | None, start: float) -> None:
        if self._metrics is not None:
            self._metrics.observe(method, code or _code_name(context), time.perf_counter() - start)

    def _wrap_unary(self, inner: Callable[..., Any], method: str, full: str) -> Callable[..., Any]:
        async def behaviour(request: Any, context: Any) -> Any:
            start = time.perf_counter()
            code: str | None = None
            CALL_DEADLINE.set(deadline_in(context.time_remaining()))
            try:
                result = inner(request, context)
                if inspect.isawaitable(result):
                    result = await result
                return result
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                answer = _grpc_answer(exc, full)
                code = answer[0].name
                await self._answer(context, method, answer, start)
            finally:
                if code is None:
                    self._record(method, context, None, start)

        return behaviour

    def _wrap_stream(self, inner: Callable[..., Any], method: str, full: str) -> Callable[..., Any]:
        async def behaviour(request: Any, context: Any) -> AsyncIterator[Any]:
            start = time.perf_counter()
            code: str | None = None
            try:
                result = inner(request, context)
                if hasattr(result, "__aiter__"):
                    async for response in result:
                        yield response
                elif inspect.isawaitable(result):
                    # A handler that streams with context.write() (e.g. Health/Watch).
                    await result
                else:
                    for response in result:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                answer = _grpc_answer(exc, full)
                code = answer[0].name
                await self._answer(context, method, answer, start)
            finally:
                if code is None:
                    self._record(method, context, None, start)

        return behaviour

    async def _answer(
        self,
        context: Any,
        method: str,
        answer: tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]],
        start: float,
    ) -> None:
        """Count the failed call, then send its status (abort raises AbortError).

        Counting first means a client that saw the error finds it in
        ``/metrics`` already.
        """
        code, details, trailing = answer
        self._record(method, context, code.name, start)
        await context.abort(code, details, trailing_metadata=trailing)


def error_status(exc: Exception, method: str) -> tuple[grpc.StatusCode, str, bytes]:
    """The status that answers a handler's exception: code, message, serialized Status.

    Ours map to their code with an ErrorInfo; a failed downstream call is
    relayed as it was; anything else is INTERNAL, logged with the trace id.
    The serialized ``google.rpc.Status`` is b"" when there are no details to
    send. Both transports answer with this (gRPC here, the lane in
    src/kvmesh/rpc/lane/server.py).
    """
    if isinstance(exc, KvmeshError):
        code = grpc.StatusCode[exc.code]
        return code, exc.message, status_details(code, exc)
    if isinstance(exc, grpc.RpcError):
        # A failed call this handler made (e.g. gateway → storage): its code and details.
        failed: Any = exc
        code = failed.code() if callable(getattr(failed, "code", None)) else grpc.StatusCode.UNKNOWN
        details = failed.details() if callable(getattr(failed, "details", None)) else str(exc)
        trailing = getattr(failed, "trailing_metadata", None)
        metadata: Any = trailing() if callable(trailing) else ()
        kept = next((value for key, value in (metadata or ()) if key == STATUS_DETAILS_KEY), b"")
        return code, details or code.name, kept
    trace_id = current_trace_id()
    logger.error("unhandled error in %s (trace_id=%s)", method, trace_id, exc_info=exc)
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error in {method}; see the server log (trace_id={trace_id})",
        b"",
    )


def _grpc_answer(
    exc: Exception, method: str
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]]:
    """:func:`error_status` as gRPC sends it: the details in trailing metadata."""
    code, details, status = error_status(exc, method)
    return code, details, ((STATUS_DETAILS_KEY, status),) if status else ()
