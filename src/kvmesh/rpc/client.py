"""The typed-client base: channels, deadlines on every call, safe retries.

Every RPC has a :class:`CallPolicy` — its default deadline and whether it is
idempotent. A call without an explicit timeout gets the policy's deadline, so
no kvmesh client call can wait forever. Only idempotent calls are retried,
and only on UNAVAILABLE (the request never reached a handler, or the server
is restarting), with short exponential backoff that never outlives the
call's own deadline.

Each service's client module subclasses :class:`SyncClient` or
:class:`AsyncClient` and writes one typed method per RPC; a test checks that
every RPC in the stubs has one.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc

from kvmesh.common.telemetry import tracing_enabled
from kvmesh.rpc.lane import AsyncLaneChannel, LaneChannel, lane_path
from kvmesh.rpc.server import DEFAULT_MAX_MESSAGE_BYTES

Resp = TypeVar("Resp")

UNAVAILABLE_RETRIES = 3
_BACKOFF_BASE_S = 0.05
_BACKOFF_MAX_S = 1.0


@dataclass(frozen=True)
class CallPolicy:
    """Default deadline (seconds) and retry safety of one RPC."""

    timeout: float
    idempotent: bool


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
    ]


def create_channel(target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A blocking channel to ``target``; traced if enabled.

    ``host:port`` and ``unix:path`` are gRPC; ``lane:path`` is the local lane
    (src/kvmesh/rpc/lane.py), which the server limits to its own
    max_message_bytes.
    """
    path = lane_path(target)
    if path is not None:
        lane: Any = LaneChannel(path)
        return cast(grpc.Channel, lane)
    channel = grpc.insecure_channel(target, options=channel_options(max_message_bytes))
    if tracing_enabled():
        from opentelemetry.instrumentation.grpc import client_interceptor, grpcext

        # The instrumentation's interceptor has its own channel wrapper (it is not a
        # grpc.*ClientInterceptor, so grpc.intercept_channel refuses it).
        channel = grpcext.intercept_channel(channel, client_interceptor())
    return channel


def create_aio_channel(
    target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` (``lane:path`` too), traced when tracing is on."""
    path = lane_path(target)
    if path is not None:
        lane: Any = AsyncLaneChannel(path)
        return cast(grpc.aio.Channel, lane)
    interceptors = None
    if tracing_enabled():
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        interceptors = aio_client_interceptors()
    return grpc.aio.insecure_channel(
        target, options=channel_options(max_message_bytes), interceptors=interceptors
    )


def _budget(policy: CallPolicy, request: Any, timeout: float | None) -> float:
    """The call's deadline in seconds: explicit, else the policy's plus any server-side wait."""
    if timeout is not None:
        return timeout
    wait_ms = getattr(request, "timeout_ms", 0) or getattr(request, "wait_timeout_ms", 0)
    return policy.timeout + wait_ms / 1000.0


def _retry_pause(
    policy: CallPolicy, exc: grpc.RpcError, attempt: int, deadline: float
) -> float | None:
    """Seconds to wait before retrying a failed call, or None to give up.

    Only idempotent calls are retried, only on UNAVAILABLE, a few times, and
    never past the call's own deadline.
    """
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    if not policy.idempotent or code != grpc.StatusCode.UNAVAILABLE:
        return None
    if attempt >= UNAVAILABLE_RETRIES:
        return None
    pause = _backoff(attempt)
    return None if time.monotonic() + pause >= deadline else pause


def _backoff(attempt: int) -> float:
    delay: float = min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * (2**attempt))
    return delay * (0.5 + random.random() / 2)


class SyncClient:
    """Base of blocking typed clients."""

    #: RPC name → policy; subclasses fill it for every RPC of their service.
    POLICIES: Mapping[str, CallPolicy] = {}

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.Channel | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.target = target
        self._owns_channel = channel is None
        self.channel = channel or create_channel(target, max_message_bytes)
        self._bind()

    def _bind(self) -> None:
        """Create the stub(s) over ``self.channel``."""

    def close(self) -> None:
        """Close the channel (if this client created it)."""
        if self._owns_channel:
            self.channel.close()

    def __enter__(self: Any) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        rpc: str,
        method: Any,
        request: Any,
        response_type: type[Resp],
        timeout: float | None,
        wait_for_ready: bool,
    ) -> Resp:
        policy = self.POLICIES[rpc]
        budget = _budget(policy, request, timeout)
        deadline = time.monotonic() + budget
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                response: Resp = method(
                    request, timeout=max(remaining, 0.001), wait_for_ready=wait_for_ready
                )
                return response
            except grpc.RpcError as exc:
                pause = _retry_pause(policy, exc, attempt, deadline)
                if pause is None:
                    raise
                time.sleep(pause)
                attempt += 1


class AsyncClient:
    """Base of asyncio typed clients."""

    POLICIES: Mapping[str, CallPolicy] = {}

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.aio.Channel | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.target = target
        self._owns_channel = channel is None
        self.channel = channel or create_aio_channel(target, max_message_bytes)
        self._bind()

    def _bind(self) -> None:
        """Create the stub(s) over ``self.channel``."""

    async def close(self) -> None:
        """Close the channel (if this client created it)."""
        if self._owns_channel:
            await self.channel.close()

    async def _call(
        self,
        rpc: str,
        method: Any,
        request: Any,
        response_type: type[Resp],
        timeout: float | None,
        wait_for_ready: bool,
    ) -> Resp:
        policy = self.POLICIES[rpc]
        budget = _budget(policy, request, timeout)
        deadline = time.monotonic() + budget
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                response: Resp = await method(
                    request, timeout=max(remaining, 0.001), wait_for_ready=wait_for_ready
                )
                return response
            except grpc.aio.AioRpcError as exc:
                pause = _retry_pause(policy, exc, attempt, deadline)
                if pause is None:
                    raise
                await asyncio.sleep(pause)
                attempt += 1
