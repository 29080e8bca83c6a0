"""Typed clients of the coordinator's operator services: policy (quotas, pins,
deletes) and admin (status, checkpoints, eviction), used by ``kvmesh status`` and
tools.

Generated once from the .proto files and maintained by hand; a test checks that
every RPC of the service has a method here and that each default deadline
matches the "Deadline:" line of the RPC's comment.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvmesh.api.coordinator.v1 import admin_pb2, policy_pb2
from kvmesh.rpc.client import CallPolicy, SyncClient


class PolicyClient(SyncClient):
    """Typed client of ``kvmesh.coordinator.v1.PolicyService``."""

    SERVICE = "kvmesh.coordinator.v1.PolicyService"
    POLICIES: Mapping[str, CallPolicy] = {
        "SetQuota": CallPolicy(timeout=5.0, idempotent=True),
        "GetQuota": CallPolicy(timeout=5.0, idempotent=True),
        "DeleteQuota": CallPolicy(timeout=5.0, idempotent=True),
        "ListQuotas": CallPolicy(timeout=5.0, idempotent=True),
        "SetDefaultQuota": CallPolicy(timeout=5.0, idempotent=True),
        "GetDefaultQuota": CallPolicy(timeout=5.0, idempotent=True),
        "PinKeys": CallPolicy(timeout=5.0, idempotent=False),
        "UnpinKeys": CallPolicy(timeout=5.0, idempotent=False),
        "ListPins": CallPolicy(timeout=5.0, idempotent=True),
        "GetUsage": CallPolicy(timeout=5.0, idempotent=True),
        "RunEviction": CallPolicy(timeout=10.0, idempotent=False),
        "DeleteKeys": CallPolicy(timeout=10.0, idempotent=False),
    }

    def set_quota(
        self,
        request: policy_pb2.SetQuotaRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.SetQuotaResponse:
        """``SetQuota``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "SetQuota",
            request,
            policy_pb2.SetQuotaResponse,
            timeout,
            wait_for_ready,
        )

    def get_quota(
        self,
        request: policy_pb2.GetQuotaRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.GetQuotaResponse:
        """``GetQuota``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "GetQuota",
            request,
            policy_pb2.GetQuotaResponse,
            timeout,
            wait_for_ready,
        )

    def delete_quota(
        self,
        request: policy_pb2.DeleteQuotaRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.DeleteQuotaResponse:
        """``DeleteQuota``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "DeleteQuota",
            request,
            policy_pb2.DeleteQuotaResponse,
            timeout,
            wait_for_ready,
        )

    def list_quotas(
        self,
        request: policy_pb2.ListQuotasRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.ListQuotasResponse:
        """``ListQuotas``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "ListQuotas",
            request,
            policy_pb2.ListQuotasResponse,
            timeout,
            wait_for_ready,
        )

    def set_default_quota(
        self,
        request: policy_pb2.SetDefaultQuotaRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.SetDefaultQuotaResponse:
        """``SetDefaultQuota``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "SetDefaultQuota",
            request,
            policy_pb2.SetDefaultQuotaResponse,
            timeout,
            wait_for_ready,
        )

    def get_default_quota(
        self,
        request: policy_pb2.GetDefaultQuotaRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.GetDefaultQuotaResponse:
        """``GetDefaultQuota``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "GetDefaultQuota",
            request,
            policy_pb2.GetDefaultQuotaResponse,
            timeout,
            wait_for_ready,
        )

    def pin_keys(
        self,
        request: policy_pb2.PinKeysRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.PinKeysResponse:
        """``PinKeys``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "PinKeys",
            request,
            policy_pb2.PinKeysResponse,
            timeout,
            wait_for_ready,
        )

    def unpin_keys(
        self,
        request: policy_pb2.UnpinKeysRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.UnpinKeysResponse:
        """``UnpinKeys``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "UnpinKeys",
            request,
            policy_pb2.UnpinKeysResponse,
            timeout,
            wait_for_ready,
        )

    def list_pins(
        self,
        request: policy_pb2.ListPinsRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.ListPinsResponse:
        """``ListPins``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "ListPins",
            request,
            policy_pb2.ListPinsResponse,
            timeout,
            wait_for_ready,
        )

    def get_usage(
        self,
        request: policy_pb2.GetUsageRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.GetUsageResponse:
        """``GetUsage``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "GetUsage",
            request,
            policy_pb2.GetUsageResponse,
            timeout,
            wait_for_ready,
        )

    def run_eviction(
        self,
        request: policy_pb2.RunEvictionRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.RunEvictionResponse:
        """``RunEviction``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "RunEviction",
            request,
            policy_pb2.RunEvictionResponse,
            timeout,
            wait_for_ready,
        )

    def delete_keys(
        self,
        request: policy_pb2.DeleteKeysRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> policy_pb2.DeleteKeysResponse:
        """``DeleteKeys``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "DeleteKeys",
            request,
            policy_pb2.DeleteKeysResponse,
            timeout,
            wait_for_ready,
        )


class AdminClient(SyncClient):
    """Typed client of ``kvmesh.coordinator.v1.AdminService``."""

    SERVICE = "kvmesh.coordinator.v1.AdminService"
    POLICIES: Mapping[str, CallPolicy] = {
        "Checkpoint": CallPolicy(timeout=60.0, idempotent=False),
        "GetStatus": CallPolicy(timeout=5.0, idempotent=True),
    }

    def checkpoint(
        self,
        request: admin_pb2.CheckpointRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> admin_pb2.CheckpointResponse:
        """``Checkpoint``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "Checkpoint",
            request,
            admin_pb2.CheckpointResponse,
            timeout,
            wait_for_ready,
        )

    def get_status(
        self,
        request: admin_pb2.GetStatusRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> admin_pb2.GetStatusResponse:
        """``GetStatus``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "GetStatus",
            request,
            admin_pb2.GetStatusResponse,
            timeout,
            wait_for_ready,
        )
