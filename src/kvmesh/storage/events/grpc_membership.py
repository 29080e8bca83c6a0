"""The registrar's gRPC client of the coordinator's ``MembershipService``.

:class:`GrpcMembershipClient` is the
:class:`~kvmesh.storage.events.registrar.MembershipClient` the storage node
registers, heartbeats and deregisters through. It may share one blocking
channel with the event stream
(:class:`~kvmesh.storage.events.grpc_transport.GrpcEventTransport`). Failed
calls are raised as core errors, so the registrar never imports grpc.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import grpc

from kvmesh.api.coordinator.v1 import membership_pb2
from kvmesh.common.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvmesh.coordinator.client import MembershipClient as MembershipRpcClient
from kvmesh.rpc.server import DEFAULT_MAX_MESSAGE_BYTES
from kvmesh.storage.events.registrar import Registration

logger = logging.getLogger(__name__)

__all__ = ["GrpcMembershipClient"]


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    # Every RpcError grpc raises is also a grpc.Call; be defensive anyway.
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.UNKNOWN, str(exc)


_ERROR_TYPES: dict[grpc.StatusCode, type[KvmeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.ABORTED: Aborted,
}


def _error_from_rpc(exc: grpc.RpcError, what: str) -> KvmeshError:
    """The core error for a failed call, so callers never need to import grpc."""
    code, details = _status(exc)
    message = f"{what}: {code.name}: {details}"
    error_type = _ERROR_TYPES.get(code)
    if error_type is not None:
        return error_type(message)
    error = KvmeshError(message)
    error.code = code.name
    return error


class GrpcMembershipClient:
    """The registrar's :class:`~kvmesh.storage.events.registrar.MembershipClient` over gRPC.

    Registers with this node's ``incarnation`` and endpoints (gateway,
    storage and metrics addresses, for operators and later peer fetches).
    Every call has a deadline: ``call_timeout_s``, else each RPC's policy
    default (5 s). Failures are raised as core errors: NOT_FOUND from a
    heartbeat is :class:`~kvmesh.common.errors.NotFound` (the registrar
    registers again), UNAVAILABLE is
    :class:`~kvmesh.common.errors.Unavailable`, and so on.
    """

    def __init__(
        self,
        target: str,
        *,
        incarnation: int,
        gateway_address: str = "",
        storage_address: str = "",
        metrics_address: str = "",
        channel: grpc.Channel | None = None,
        call_timeout_s: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        if incarnation < 0:
            raise InvalidArgument("incarnation must be >= 0", field="incarnation")
        self._incarnation = incarnation
        self._endpoints = membership_pb2.InstanceEndpoints(
            gateway_address=gateway_address,
            storage_address=storage_address,
            metrics_address=metrics_address,
        )
        self._timeout = call_timeout_s
        self._client = MembershipRpcClient(
            target, channel=channel, max_message_bytes=max_message_bytes
        )

    @property
    def target(self) -> str:
        """The coordinator address this client dials."""
        return self._client.target

    def register(self, instance_id: str, metadata: Mapping[str, str]) -> Registration:
        """``RegisterInstance``; returns the coordinator's answer with its intervals in seconds."""
        request = membership_pb2.RegisterInstanceRequest(
            instance_id=instance_id,
            incarnation=self._incarnation,
            endpoints=self._endpoints,
            metadata=dict(metadata),
        )
        try:
            response = self._client.register_instance(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            raise _error_from_rpc(exc, "RegisterInstance") from exc
        return Registration(
            instance_id=response.instance_id,
            re_registered=response.re_registered,
            heartbeat_interval_s=response.heartbeat_interval_ms / 1000.0,
            instance_timeout_s=response.instance_timeout_ms / 1000.0,
        )

    def heartbeat(self, instance_id: str) -> None:
        """``Heartbeat``; raises NotFound when the coordinator forgot this node."""
        try:
            self._client.heartbeat(
                membership_pb2.HeartbeatRequest(instance_id=instance_id), timeout=self._timeout
            )
        except grpc.RpcError as exc:
            raise _error_from_rpc(exc, "Heartbeat") from exc

    def deregister(self, instance_id: str) -> None:
        """``DeregisterInstance`` (idempotent on the coordinator)."""
        try:
            self._client.deregister_instance(
                membership_pb2.DeregisterInstanceRequest(instance_id=instance_id),
                timeout=self._timeout,
            )
        except grpc.RpcError as exc:
            raise _error_from_rpc(exc, "DeregisterInstance") from exc

    def close(self) -> None:
        """Close the channel (when this client created it)."""
        self._client.close()
