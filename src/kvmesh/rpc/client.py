"""The typed-client base: a transport per client, deadlines on every call, safe retries.

Every RPC has a :class:`CallPolicy` — its default deadline and whether it is
idempotent. A call without an explicit timeout gets the policy's deadline, so
no kvmesh client call can wait forever. Only idempotent calls are retried,
and only on UNAVAILABLE (the request never reached a handler, or the server
is restarting), with short exponential backoff that never outlives the
call's own deadline.

A client serializes the request, hands the bytes to its transport
(src/kvmesh/rpc/transport.py: gRPC for ``host:port`` and ``unix:path``, the
local lane for ``lane:path``) and parses the response. A failed call raises
:class:`~kvmesh.rpc.errors.RpcError` — a ``grpc.RpcError`` with ``code()``,
``details()`` and the server's ErrorInfo — whichever transport carried it.

Each service's client module subclasses :class:`SyncClient` or
:class:`AsyncClient`, names its ``SERVICE`` and writes one typed method per
RPC; a test checks that every RPC in the stubs has one. Importing a client
loads no server module, no Prometheus and no YAML (a vLLM connector imports
one); a test checks that too.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from kvmesh.rpc.errors import RpcError
from kvmesh.rpc.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    AsyncGrpcTransport,
    AsyncTransport,
    GrpcTransport,
    Transport,
    connect,
    connect_async,
    create_aio_channel,
    create_channel,
)

__all__ = [
    "AsyncClient",
    "CallPolicy",
    "RpcError",
    "SyncClient",
    # Re-exported: callers made channels through this module before the transports moved.
    "create_aio_channel",
    "create_channel",
]

Resp = TypeVar("Resp", bound=Message)

UNAVAILABLE_RETRIES = 3
_BACKOFF_BASE_S = 0.05
_BACKOFF_MAX_S = 1.0


@dataclass(frozen=True)
class CallPolicy:
    """Default deadline (seconds) and retry safety of one RPC."""

    timeout: float
    idempotent: bool


def _budget(policy: CallPolicy, request: Any, timeout: float | None) -> float:
    """The call's deadline in seconds: explicit, else the policy's plus any server-side wait."""
    if timeout is not None:
        return timeout
    wait_ms = getattr(request, "timeout_ms", 0) or getattr(request, "wait_timeout_ms", 0)
    return policy.timeout + wait_ms / 1000.0


def _retry_pause(
    policy: CallPolicy, exc: RpcError, attempt: int, deadline: float, retries: int
) -> float | None:
    """Seconds to wait before retrying a failed call, or None to give up.

    Only idempotent calls are retried, only on UNAVAILABLE, ``retries`` times
    at most, and never past the call's own deadline.
    """
    if not policy.idempotent or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    if attempt >= retries:
        return None
    pause = _backoff(attempt)
    return None if time.monotonic() + pause >= deadline else pause


def _backoff(attempt: int) -> float:
    delay: float = min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * (2**attempt))
    return delay * (0.5 + random.random() / 2)


#: Transport failures: the call may never have reached a handler of the service.
_TRANSPORT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_UNREACHABLE = "cannot reach "


def hop_name(service: str) -> str:
    """``storage`` for ``kvmesh.storage.v1.StorageService``: the hop an error names."""
    parts = service.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "kvmesh" else service or "server"


def located(exc: RpcError, service: str, target: str) -> RpcError:
    """``exc`` naming the hop and the address it failed at, when the transport failed.

    A server's own answers (they carry a ``google.rpc.Status``) are returned
    unchanged. A failure to reach the server becomes ``cannot reach storage
    at 127.0.0.1:1: ...``; one a server we did reach relayed from its own next
    hop becomes ``gateway at ADDR: cannot reach storage at ...``, so the
    message says which hop of the chain failed.
    """
    if exc.code() not in _TRANSPORT_CODES or exc.status():
        return exc
    details = exc.details()
    hop = hop_name(service)
    if details.startswith(_UNREACHABLE) or " at " in details.split(":", 1)[0]:
        text = f"{hop} at {target}: {details}"
    elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        text = f"{hop} at {target} did not answer in time ({details})"
    else:
        text = f"{_UNREACHABLE}{hop} at {target}: {details}"
    return RpcError(exc.code(), text, exc.status())


def _parse(response_type: type[Resp], body: bytes, path: str) -> Resp:
    try:
        return response_type.FromString(body)
    except DecodeError as exc:
        raise RpcError(
            grpc.StatusCode.INTERNAL, f"the response of {path} does not parse: {exc}"
        ) from None


def _paths(cls: type[Any]) -> dict[str, str]:
    return {rpc: f"/{cls.SERVICE}/{rpc}" for rpc in cls.POLICIES}


class SyncClient:
    """Base of blocking typed clients.

    ``channel`` shares a gRPC channel (or a transport) among clients; the
    client then does not close it. ``self.channel`` is the gRPC channel,
    None on a lane (streaming RPCs need it).
    """

    #: Full name of the service, e.g. ``kvmesh.gateway.v1.GatewayService``.
    SERVICE: ClassVar[str] = ""
    #: RPC name → policy; subclasses fill it for every RPC of their service.
    POLICIES: Mapping[str, CallPolicy] = {}

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.Channel | Transport | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        unavailable_retries: int = UNAVAILABLE_RETRIES,
    ) -> None:
        self.target = target
        #: Retries of an idempotent call that found the server unavailable (0: fail at
        #: once, for callers that must never wait, such as an engine's connector).
        self.unavailable_retries = unavailable_retries
        self._owns_transport = channel is None
        transport: Transport
        if channel is None:
            transport = connect(target, max_message_bytes)
        elif isinstance(channel, grpc.Channel):
            transport = GrpcTransport(channel)
        else:
            transport = channel
        self.transport = transport
        self.channel: grpc.Channel | None = (
            transport.channel if isinstance(transport, GrpcTransport) else None
        )
        self._path = _paths(type(self))
        self._bind()

    def _bind(self) -> None:
        """Set up what the subclass needs besides the transport (a streaming stub)."""

    def wait_holding_gil(self, rpc: str, seconds: float) -> None:
        """Wait up to ``seconds`` for ``rpc``'s answers without releasing the GIL.

        Only the local lane's blocking transport can (LaneTransport.wait_holding_gil
        in src/kvmesh/rpc/lane/client.py); on gRPC this does nothing.
        """
        hold = getattr(self.transport, "wait_holding_gil", None)
        if hold is not None:
            hold(self._path[rpc], seconds)

    def close(self) -> None:
        """Close the transport (if this client created it)."""
        if self._owns_transport:
            self.transport.close()

    def __enter__(self: Any) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        rpc: str,
        request: Message,
        response_type: type[Resp],
        timeout: float | None,
        wait_for_ready: bool,
    ) -> Resp:
        policy = self.POLICIES[rpc]
        path = self._path[rpc]
        payload = request.SerializeToString()
        deadline = time.monotonic() + _budget(policy, request, timeout)
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                body = self.transport.call(path, payload, max(remaining, 0.001), wait_for_ready)
            except RpcError as exc:
                pause = _retry_pause(policy, exc, attempt, deadline, self.unavailable_retries)
                if pause is None:
                    raise located(exc, self.SERVICE, self.target) from None
                time.sleep(pause)
                attempt += 1
                continue
            return _parse(response_type, body, path)


class AsyncClient:
    """Base of asyncio typed clients (see :class:`SyncClient`)."""

    SERVICE: ClassVar[str] = ""
    POLICIES: Mapping[str, CallPolicy] = {}

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.aio.Channel | AsyncTransport | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        unavailable_retries: int = UNAVAILABLE_RETRIES,
    ) -> None:
        self.target = target
        #: Retries of an idempotent call that found the server unavailable (see SyncClient).
        self.unavailable_retries = unavailable_retries
        self._owns_transport = channel is None
        transport: AsyncTransport
        if channel is None:
            transport = connect_async(target, max_message_bytes)
        elif isinstance(channel, grpc.aio.Channel):
            transport = AsyncGrpcTransport(channel)
        else:
            transport = channel
        self.transport = transport
        self.channel: grpc.aio.Channel | None = (
            transport.channel if isinstance(transport, AsyncGrpcTransport) else None
        )
        self._path = _paths(type(self))
        self._bind()

    def _bind(self) -> None:
        """Set up what the subclass needs besides the transport."""

    async def close(self) -> None:
        """Close the transport (if this client created it)."""
        if self._owns_transport:
            await self.transport.close()

    async def _call(
        self,
        rpc: str,
        request: Message,
        response_type: type[Resp],
        timeout: float | None,
        wait_for_ready: bool,
    ) -> Resp:
        policy = self.POLICIES[rpc]
        path = self._path[rpc]
        payload = request.SerializeToString()
        deadline = time.monotonic() + _budget(policy, request, timeout)
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                body = await self.transport.call(
                    path, payload, max(remaining, 0.001), wait_for_ready
                )
            except RpcError as exc:
                pause = _retry_pause(policy, exc, attempt, deadline, self.unavailable_retries)
                if pause is None:
                    raise located(exc, self.SERVICE, self.target) from None
                await asyncio.sleep(pause)
                attempt += 1
                continue
            return _parse(response_type, body, path)
