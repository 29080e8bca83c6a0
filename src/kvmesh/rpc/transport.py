"""The typed clients' transport seam, and its gRPC implementation.

A transport makes one unary call: the method's full path
(``/kvmesh.gateway.v1.GatewayService/Lookup``), the serialized request and a
timeout in, the serialized response out — or :class:`~kvmesh.rpc.errors.RpcError`
with the call's status code, message and status details. The typed clients
(src/kvmesh/rpc/client.py) serialize, pick deadlines and retry above it and
never see which transport carries the bytes:

- :class:`GrpcTransport` / :class:`AsyncGrpcTransport`: a gRPC channel
  (``host:port``, ``unix:path``), traced when tracing is on;
- ``LaneTransport`` / ``AsyncLaneTransport`` (src/kvmesh/rpc/lane/client.py):
  the local lane (``lane:path``).

:func:`connect` and :func:`connect_async` pick one by the target. Streaming
RPCs do not go through the seam: a client that has one uses the gRPC
channel itself.

Client-side module: it loads neither a server nor Prometheus.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc

from kvmesh.common.telemetry import BACKGROUND_USER_AGENT, tracing_enabled, untraced_calls
from kvmesh.rpc.errors import RpcError
from kvmesh.rpc.lane.client import AsyncLaneTransport, LaneTransport
from kvmesh.rpc.lane.framing import lane_path

#: Largest message a kvmesh client or server sends or accepts, unless configured.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class Transport(Protocol):
    """What a blocking typed client calls through."""

    def call(
        self, method: str, request: bytes, timeout: float | None, wait_for_ready: bool = False
    ) -> bytes:
        """One unary call: the response bytes, or RpcError."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class AsyncTransport(Protocol):
    """What an asyncio typed client calls through."""

    async def call(
        self, method: str, request: bytes, timeout: float | None, wait_for_ready: bool = False
    ) -> bytes:
        """One unary call: the response bytes, or RpcError."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel arguments of every kvmesh client."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Fail fast while a server restarts; our own retry loop paces reconnects.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # Connections of this channel only. gRPC otherwise shares them, through a
        # process-wide pool, with every channel to the same address and the same
        # arguments: a channel left open to a server that died then made a new
        # client to a new server on that address fail at once with the old
        # "Connection refused" until the old connection's back-off ended
        # (tests/integration/rpc/test_channel_state.py).
        ("grpc.use_local_subchannel_pool", 1),
    ]


def _grpc_target(target: str) -> str:
    if lane_path(target) is not None:
        raise ValueError(
            f"{target} is a local lane, which has no gRPC channel: dial it with a typed "
            "client or kvmesh.rpc.transport.connect()"
        )
    return target


def create_channel(
    target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *, background: bool = False
) -> grpc.Channel:
    """A blocking gRPC channel to ``host:port`` or ``unix:path``; traced if enabled.

    ``background``: for calls made on the process's own clock (a poll), never
    traced; its user agent tells the server not to trace them either.
    """
    options = channel_options(max_message_bytes)
    if background:
        options.append(("grpc.primary_user_agent", BACKGROUND_USER_AGENT))
    channel = grpc.insecure_channel(_grpc_target(target), options=options)
    if tracing_enabled() and not background:
        from opentelemetry.instrumentation.grpc import client_interceptor, grpcext

        # The instrumentation's interceptor has its own channel wrapper (it is not a
        # grpc.*ClientInterceptor, so grpc.intercept_channel refuses it).
        channel = grpcext.intercept_channel(channel, client_interceptor(filter_=untraced_calls()))
    return channel


def create_aio_channel(
    target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> grpc.aio.Channel:
    """An asyncio gRPC channel to ``host:port`` or ``unix:path``; traced if enabled."""
    interceptors = None
    if tracing_enabled():
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        interceptors = aio_client_interceptors(filter_=untraced_calls())
    return grpc.aio.insecure_channel(
        _grpc_target(target), options=channel_options(max_message_bytes), interceptors=interceptors
    )


class GrpcTransport:
    """Unary calls as bytes over a blocking gRPC channel.

    The channel's multi-callables have no (de)serializers: bytes go through
    as they are. A failed call raises :class:`RpcError`.
    """

    def __init__(self, channel: grpc.Channel, *, owned: bool = False) -> None:
        self.channel = channel
        self._owned = owned
        self._callables: dict[str, Any] = {}

    def call(
        self, method: str, request: bytes, timeout: float | None, wait_for_ready: bool = False
    ) -> bytes:
        invoke = self._callables.get(method)
        if invoke is None:
            invoke = self._callables[method] = self.channel.unary_unary(method)
        try:
            response: bytes = invoke(request, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise RpcError.from_grpc(exc) from None
        return response

    def close(self) -> None:
        """Close the channel if this transport created it."""
        if self._owned:
            self.channel.close()


class AsyncGrpcTransport:
    """Unary calls as bytes over an asyncio gRPC channel; errors as :class:`RpcError`."""

    def __init__(self, channel: grpc.aio.Channel, *, owned: bool = False) -> None:
        self.channel = channel
        self._owned = owned
        self._callables: dict[str, Any] = {}

    async def call(
        self, method: str, request: bytes, timeout: float | None, wait_for_ready: bool = False
    ) -> bytes:
        invoke = self._callables.get(method)
        if invoke is None:
            invoke = self._callables[method] = self.channel.unary_unary(method)
        try:
            response: bytes = await invoke(request, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise RpcError.from_grpc(exc) from None
        return response

    async def close(self) -> None:
        """Close the channel if this transport created it."""
        if self._owned:
            await self.channel.close()


def connect(
    target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> GrpcTransport | LaneTransport:
    """A blocking transport to ``target``: the local lane for ``lane:path``, else gRPC.

    A lane's limit on message size is the server's own ``max_message_bytes``
    (it says so when a connection opens).
    """
    path = lane_path(target)
    if path is not None:
        return LaneTransport(path)
    return GrpcTransport(create_channel(target, max_message_bytes), owned=True)


def connect_async(
    target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> AsyncGrpcTransport | AsyncLaneTransport:
    """An asyncio transport to ``target``: the local lane for ``lane:path``, else gRPC."""
    path = lane_path(target)
    if path is not None:
        return AsyncLaneTransport(path)
    return AsyncGrpcTransport(create_aio_channel(target, max_message_bytes), owned=True)
