"""Typed client of the gateway: what a vLLM connector imports to talk to kvmesh.

Generated once from the .proto files and maintained by hand; a test checks that
every RPC of the service has a method here and that each default deadline
matches the "Deadline:" line of the RPC's comment.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.rpc.client import CallPolicy, SyncClient


class GatewayClient(SyncClient):
    """Typed client of ``kvmesh.gateway.v1.GatewayService``."""

    SERVICE = "kvmesh.gateway.v1.GatewayService"
    POLICIES: Mapping[str, CallPolicy] = {
        "RegisterKVCache": CallPolicy(timeout=30.0, idempotent=True),
        "UnregisterKVCache": CallPolicy(timeout=10.0, idempotent=True),
        "Lookup": CallPolicy(timeout=5.0, idempotent=True),
        "QueryPrefetchStatus": CallPolicy(timeout=2.0, idempotent=True),
        "WaitPrefetchStatus": CallPolicy(timeout=2.0, idempotent=True),
        "FreeLookupLocks": CallPolicy(timeout=2.0, idempotent=False),
        "EndSession": CallPolicy(timeout=2.0, idempotent=True),
        "Store": CallPolicy(timeout=30.0, idempotent=True),
        "Retrieve": CallPolicy(timeout=30.0, idempotent=False),
        # A repeat starts nothing (the gateway remembers the load), so a retry is safe.
        "RetrieveAhead": CallPolicy(timeout=2.0, idempotent=True),
        "Clear": CallPolicy(timeout=30.0, idempotent=True),
        "GetChunkSize": CallPolicy(timeout=2.0, idempotent=True),
        "Ping": CallPolicy(timeout=2.0, idempotent=True),
        "ReportBlockAllocation": CallPolicy(timeout=2.0, idempotent=True),
        "RegisterEngineContext": CallPolicy(timeout=10.0, idempotent=True),
        "UnregisterEngineContext": CallPolicy(timeout=10.0, idempotent=True),
        "PrepareStore": CallPolicy(timeout=10.0, idempotent=False),
        "CommitStore": CallPolicy(timeout=10.0, idempotent=True),
        "PrepareRetrieve": CallPolicy(timeout=10.0, idempotent=False),
        "CommitRetrieve": CallPolicy(timeout=10.0, idempotent=False),
        "PrepareSegmentStore": CallPolicy(timeout=10.0, idempotent=False),
        "PrepareSegmentRetrieve": CallPolicy(timeout=10.0, idempotent=False),
        "LookupSegments": CallPolicy(timeout=10.0, idempotent=True),
        "StoreSegment": CallPolicy(timeout=30.0, idempotent=True),
        # Writes the same bytes again and holds no lock past the call: safe to retry.
        "RetrieveSegment": CallPolicy(timeout=30.0, idempotent=True),
    }

    @functools.cached_property
    def _stub(self) -> gateway_pb2_grpc.GatewayServiceStub:
        """The generated stub over the gRPC channel (gRPC targets only).

        For what the typed methods do not offer, such as a call's future to
        cancel it mid-flight; the typed methods go through the transport.
        """
        if self.channel is None:
            raise ValueError(f"{self.target} is a local lane: it has no gRPC stub")
        return gateway_pb2_grpc.GatewayServiceStub(self.channel)

    def register_kv_cache(
        self,
        request: gateway_pb2.RegisterKVCacheRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.RegisterKVCacheResponse:
        """``RegisterKVCache``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "RegisterKVCache",
            request,
            gateway_pb2.RegisterKVCacheResponse,
            timeout,
            wait_for_ready,
        )

    def unregister_kv_cache(
        self,
        request: gateway_pb2.UnregisterKVCacheRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.UnregisterKVCacheResponse:
        """``UnregisterKVCache``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "UnregisterKVCache",
            request,
            gateway_pb2.UnregisterKVCacheResponse,
            timeout,
            wait_for_ready,
        )

    def lookup(
        self,
        request: gateway_pb2.LookupRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.LookupResponse:
        """``Lookup``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "Lookup",
            request,
            gateway_pb2.LookupResponse,
            timeout,
            wait_for_ready,
        )

    def query_prefetch_status(
        self,
        request: gateway_pb2.QueryPrefetchStatusRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.QueryPrefetchStatusResponse:
        """``QueryPrefetchStatus``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "QueryPrefetchStatus",
            request,
            gateway_pb2.QueryPrefetchStatusResponse,
            timeout,
            wait_for_ready,
        )

    def wait_prefetch_status(
        self,
        request: gateway_pb2.WaitPrefetchStatusRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.WaitPrefetchStatusResponse:
        """``WaitPrefetchStatus``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "WaitPrefetchStatus",
            request,
            gateway_pb2.WaitPrefetchStatusResponse,
            timeout,
            wait_for_ready,
        )

    def free_lookup_locks(
        self,
        request: gateway_pb2.FreeLookupLocksRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.FreeLookupLocksResponse:
        """``FreeLookupLocks``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "FreeLookupLocks",
            request,
            gateway_pb2.FreeLookupLocksResponse,
            timeout,
            wait_for_ready,
        )

    def end_session(
        self,
        request: gateway_pb2.EndSessionRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.EndSessionResponse:
        """``EndSession``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "EndSession",
            request,
            gateway_pb2.EndSessionResponse,
            timeout,
            wait_for_ready,
        )

    def store(
        self,
        request: gateway_pb2.StoreRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.StoreResponse:
        """``Store``: see its comment in the .proto for semantics and errors."""
        return self._call("Store", request, gateway_pb2.StoreResponse, timeout, wait_for_ready)

    def retrieve(
        self,
        request: gateway_pb2.RetrieveRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.RetrieveResponse:
        """``Retrieve``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "Retrieve",
            request,
            gateway_pb2.RetrieveResponse,
            timeout,
            wait_for_ready,
        )

    def retrieve_ahead(
        self,
        request: gateway_pb2.RetrieveRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.RetrieveAheadResponse:
        """``RetrieveAhead``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "RetrieveAhead",
            request,
            gateway_pb2.RetrieveAheadResponse,
            timeout,
            wait_for_ready,
        )

    def clear(
        self,
        request: gateway_pb2.ClearRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.ClearResponse:
        """``Clear``: see its comment in the .proto for semantics and errors."""
        return self._call("Clear", request, gateway_pb2.ClearResponse, timeout, wait_for_ready)

    def get_chunk_size(
        self,
        request: gateway_pb2.GetChunkSizeRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.GetChunkSizeResponse:
        """``GetChunkSize``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "GetChunkSize",
            request,
            gateway_pb2.GetChunkSizeResponse,
            timeout,
            wait_for_ready,
        )

    def ping(
        self,
        request: gateway_pb2.PingRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.PingResponse:
        """``Ping``: see its comment in the .proto for semantics and errors."""
        return self._call("Ping", request, gateway_pb2.PingResponse, timeout, wait_for_ready)

    def report_block_allocation(
        self,
        request: gateway_pb2.ReportBlockAllocationRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.ReportBlockAllocationResponse:
        """``ReportBlockAllocation``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "ReportBlockAllocation",
            request,
            gateway_pb2.ReportBlockAllocationResponse,
            timeout,
            wait_for_ready,
        )

    def register_engine_context(
        self,
        request: gateway_pb2.RegisterEngineContextRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.RegisterEngineContextResponse:
        """``RegisterEngineContext``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "RegisterEngineContext",
            request,
            gateway_pb2.RegisterEngineContextResponse,
            timeout,
            wait_for_ready,
        )

    def unregister_engine_context(
        self,
        request: gateway_pb2.UnregisterEngineContextRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.UnregisterEngineContextResponse:
        """``UnregisterEngineContext``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "UnregisterEngineContext",
            request,
            gateway_pb2.UnregisterEngineContextResponse,
            timeout,
            wait_for_ready,
        )

    def prepare_store(
        self,
        request: gateway_pb2.PrepareStoreRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.PrepareStoreResponse:
        """``PrepareStore``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "PrepareStore",
            request,
            gateway_pb2.PrepareStoreResponse,
            timeout,
            wait_for_ready,
        )

    def commit_store(
        self,
        request: gateway_pb2.CommitStoreRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.CommitStoreResponse:
        """``CommitStore``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "CommitStore",
            request,
            gateway_pb2.CommitStoreResponse,
            timeout,
            wait_for_ready,
        )

    def prepare_retrieve(
        self,
        request: gateway_pb2.PrepareRetrieveRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.PrepareRetrieveResponse:
        """``PrepareRetrieve``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "PrepareRetrieve",
            request,
            gateway_pb2.PrepareRetrieveResponse,
            timeout,
            wait_for_ready,
        )

    def commit_retrieve(
        self,
        request: gateway_pb2.CommitRetrieveRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.CommitRetrieveResponse:
        """``CommitRetrieve``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "CommitRetrieve",
            request,
            gateway_pb2.CommitRetrieveResponse,
            timeout,
            wait_for_ready,
        )

    def prepare_segment_store(
        self,
        request: gateway_pb2.PrepareSegmentStoreRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.PrepareSegmentStoreResponse:
        """``PrepareSegmentStore``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "PrepareSegmentStore",
            request,
            gateway_pb2.PrepareSegmentStoreResponse,
            timeout,
            wait_for_ready,
        )

    def prepare_segment_retrieve(
        self,
        request: gateway_pb2.PrepareSegmentRetrieveRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.PrepareSegmentRetrieveResponse:
        """``PrepareSegmentRetrieve``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "PrepareSegmentRetrieve",
            request,
            gateway_pb2.PrepareSegmentRetrieveResponse,
            timeout,
            wait_for_ready,
        )

    def lookup_segments(
        self,
        request: gateway_pb2.LookupSegmentsRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.LookupSegmentsResponse:
        """``LookupSegments``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "LookupSegments",
            request,
            gateway_pb2.LookupSegmentsResponse,
            timeout,
            wait_for_ready,
        )

    def store_segment(
        self,
        request: gateway_pb2.StoreSegmentRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.StoreSegmentResponse:
        """``StoreSegment``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "StoreSegment", request, gateway_pb2.StoreSegmentResponse, timeout, wait_for_ready
        )

    def retrieve_segment(
        self,
        request: gateway_pb2.RetrieveSegmentRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> gateway_pb2.RetrieveSegmentResponse:
        """``RetrieveSegment``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "RetrieveSegment", request, gateway_pb2.RetrieveSegmentResponse, timeout,
            wait_for_ready,
        )  # fmt: skip
