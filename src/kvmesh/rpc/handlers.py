"""Where a server's method handlers are registered, and the one decode path of requests.

A request whose bytes do not parse as the method's request message is the
caller's fault: every transport answers it with INVALID_ARGUMENT and a
``google.rpc.ErrorInfo`` whose reason is ``MALFORMED_REQUEST`` (the
:func:`malformed_request` error, mapped like any other
:class:`~kvmesh.common.errors.InvalidArgument`) — never UNKNOWN or INTERNAL,
and never a traceback in the log.

gRPC Python deserializes a request in its own layer, before any handler or
interceptor runs, and answers a parse failure there (UNKNOWN, or INTERNAL and
a traceback on a stream). So :class:`HandlerRegistry`, which stands in for
the server when a binding registers its servicer, hands gRPC each handler
with a request deserializer that turns a ``DecodeError`` into a marker, and
a behaviour that raises :func:`malformed_request` for the marker — inside
the error-mapping interceptor, which answers it. On a stream the bad message
ends the call at the point where the handler reads it, so what the handler
applied before it stays applied. The lane (src/kvmesh/rpc/lane/server.py)
parses requests itself and raises the same error.

The registry also keeps every handler it saw, for the lane server to
dispatch to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvmesh.common.errors import InvalidArgument

#: The ErrorInfo reason of a request that does not parse.
MALFORMED_REQUEST = "MALFORMED_REQUEST"


def malformed_request(method: str, exc: DecodeError) -> InvalidArgument:
    """The error that answers a request to ``method`` whose bytes do not parse."""
    return InvalidArgument(
        f"the request to {method} does not parse: {exc}",
        reason=MALFORMED_REQUEST,
        metadata={"method": method},
    )


class _Undecodable:
    """What the request deserializer returns for bytes that do not parse."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def decoding_handler(
    handler: grpc.RpcMethodHandler[Any, Any], method: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with requests that do not parse answered INVALID_ARGUMENT (see above)."""
    deserialize = handler.request_deserializer
    if deserialize is None:
        return handler

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as exc:
            return _Undecodable(malformed_request(method, exc))

    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _unary(handler.unary_unary), request_deserializer=decode, response_serializer=serialize
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _unary(handler.unary_stream), request_deserializer=decode, response_serializer=serialize
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _streaming(handler.stream_unary),
            request_deserializer=decode,
            response_serializer=serialize,
        )
    assert handler.stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(
        _streaming(handler.stream_stream),
        request_deserializer=decode,
        response_serializer=serialize,
    )


def _unary(inner: Callable[..., Any]) -> Callable[..., Any]:
    # A plain function: the interceptor awaits or iterates what it returns.
    def behaviour(request: Any, context: Any) -> Any:
        if type(request) is _Undecodable:
            raise request.error
        return inner(request, context)

    return behaviour


def _streaming(inner: Callable[..., Any]) -> Callable[..., Any]:
    def behaviour(requests: AsyncIterator[Any], context: Any) -> Any:
        return inner(_checked(requests), context)

    return behaviour


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The requests of a stream, up to one that does not parse (which raises)."""
    async for request in requests:
        if type(request) is _Undecodable:
            raise request.error
        yield request


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


class _DecodingGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose handlers go through :func:`decoding_handler`."""

    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            found = self._inner.service(handler_call_details)
            if found is None:
                return None  # unknown methods must not grow the cache
            wrapped = self._wrapped[method] = decoding_handler(found, method)
        return wrapped


class HandlerRegistry:
    """What a binding's ``add_*Servicer_to_server`` registers on (it stands for the server).

    Each handler goes on to the gRPC server (when there is one) through
    :func:`decoding_handler`, and is kept as it was for :meth:`handler`.
    """

    def __init__(self, server: grpc.aio.Server | None = None) -> None:
        self._server = server
        self._registered: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        self._generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)
        if self._server is not None:
            self._server.add_generic_rpc_handlers(
                [_DecodingGenericHandler(handler) for handler in handlers]
            )

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        for name, handler in handlers.items():
            self._registered[f"/{service}/{name}"] = handler
        if self._server is not None:
            self._server.add_registered_method_handlers(
                service,
                {
                    name: decoding_handler(handler, f"/{service}/{name}")
                    for name, handler in handlers.items()
                },
            )

    def handler(self, method: str) -> grpc.RpcMethodHandler[Any, Any] | None:
        """The handler registered for the full method path, as the servicer gave it."""
        found = self._registered.get(method)
        if found is not None:
            return found
        details = _CallDetails(method)
        for generic in self._generic:
            found = generic.service(details)
            if found is not None:
                return found
        return None
