"""Typed client of the coordinator's EngineService (engines followed for routing).

Like :mod:`kvmesh.coordinator.client`: every RPC has a method, and each
default deadline matches the "Deadline:" line of the RPC's comment.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvmesh.api.coordinator.v1 import engines_pb2
from kvmesh.rpc.client import CallPolicy, SyncClient


class EngineClient(SyncClient):
    """Typed client of ``kvmesh.coordinator.v1.EngineService``."""

    SERVICE = "kvmesh.coordinator.v1.EngineService"
    POLICIES: Mapping[str, CallPolicy] = {
        "RegisterEngine": CallPolicy(timeout=5.0, idempotent=True),
        "DeregisterEngine": CallPolicy(timeout=5.0, idempotent=True),
        "ListEngines": CallPolicy(timeout=5.0, idempotent=True),
    }

    def register_engine(
        self,
        request: engines_pb2.RegisterEngineRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> engines_pb2.RegisterEngineResponse:
        """``RegisterEngine``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "RegisterEngine",
            request,
            engines_pb2.RegisterEngineResponse,
            timeout,
            wait_for_ready,
        )

    def deregister_engine(
        self,
        request: engines_pb2.DeregisterEngineRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> engines_pb2.DeregisterEngineResponse:
        """``DeregisterEngine``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "DeregisterEngine",
            request,
            engines_pb2.DeregisterEngineResponse,
            timeout,
            wait_for_ready,
        )

    def list_engines(
        self,
        request: engines_pb2.ListEnginesRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> engines_pb2.ListEnginesResponse:
        """``ListEngines``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "ListEngines",
            request,
            engines_pb2.ListEnginesResponse,
            timeout,
            wait_for_ready,
        )
