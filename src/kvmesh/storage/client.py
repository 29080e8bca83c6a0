"""Typed asyncio client of a storage node (the gateway's view of its node).

Generated once from the .proto files and maintained by hand; a test checks that
every RPC of the service has a method here and that each default deadline
matches the "Deadline:" line of the RPC's comment.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.rpc.client import AsyncClient, CallPolicy


class StorageClient(AsyncClient):
    """Typed asyncio client of ``kvmesh.storage.v1.StorageService``."""

    SERVICE = "kvmesh.storage.v1.StorageService"
    POLICIES: Mapping[str, CallPolicy] = {
        "RegisterEngineMemory": CallPolicy(timeout=30.0, idempotent=True),
        "UnregisterEngineMemory": CallPolicy(timeout=10.0, idempotent=True),
        "StoreChunks": CallPolicy(timeout=30.0, idempotent=True),
        "LookupAndLock": CallPolicy(timeout=5.0, idempotent=True),
        "GetPrefetchStatus": CallPolicy(timeout=2.0, idempotent=True),
        "ReleasePrefetch": CallPolicy(timeout=2.0, idempotent=True),
        "ReleaseLease": CallPolicy(timeout=2.0, idempotent=True),
        "EndOwnerLeases": CallPolicy(timeout=2.0, idempotent=True),
        "RetrieveChunks": CallPolicy(timeout=30.0, idempotent=False),
        "StoreSegment": CallPolicy(timeout=30.0, idempotent=True),
        # Writes the same bytes again and holds no lock past the call: safe to retry.
        "RetrieveSegment": CallPolicy(timeout=30.0, idempotent=True),
        "FindSegments": CallPolicy(timeout=10.0, idempotent=True),
        "ReleaseLocks": CallPolicy(timeout=2.0, idempotent=False),
        "TouchKeys": CallPolicy(timeout=2.0, idempotent=True),
        "DeleteKeys": CallPolicy(timeout=30.0, idempotent=False),
        "Clear": CallPolicy(timeout=30.0, idempotent=True),
        "GetStatus": CallPolicy(timeout=5.0, idempotent=True),
        "ListObjects": CallPolicy(timeout=10.0, idempotent=True),
        "SetQuota": CallPolicy(timeout=5.0, idempotent=True),
        "GetQuota": CallPolicy(timeout=5.0, idempotent=True),
        "DeleteQuota": CallPolicy(timeout=5.0, idempotent=True),
        "ListQuotas": CallPolicy(timeout=5.0, idempotent=True),
        "PrepareStore": CallPolicy(timeout=10.0, idempotent=False),
        "CommitStore": CallPolicy(timeout=10.0, idempotent=True),
        "PrepareRetrieve": CallPolicy(timeout=10.0, idempotent=False),
        "CommitRetrieve": CallPolicy(timeout=10.0, idempotent=True),
    }

    async def register_engine_memory(
        self,
        request: storage_pb2.RegisterEngineMemoryRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.RegisterEngineMemoryResponse:
        """``RegisterEngineMemory``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "RegisterEngineMemory",
            request,
            storage_pb2.RegisterEngineMemoryResponse,
            timeout,
            wait_for_ready,
        )

    async def unregister_engine_memory(
        self,
        request: storage_pb2.UnregisterEngineMemoryRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.UnregisterEngineMemoryResponse:
        """``UnregisterEngineMemory``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "UnregisterEngineMemory",
            request,
            storage_pb2.UnregisterEngineMemoryResponse,
            timeout,
            wait_for_ready,
        )

    async def store_chunks(
        self,
        request: storage_pb2.StoreChunksRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.StoreChunksResponse:
        """``StoreChunks``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "StoreChunks",
            request,
            storage_pb2.StoreChunksResponse,
            timeout,
            wait_for_ready,
        )

    async def lookup_and_lock(
        self,
        request: storage_pb2.LookupAndLockRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.LookupAndLockResponse:
        """``LookupAndLock``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "LookupAndLock",
            request,
            storage_pb2.LookupAndLockResponse,
            timeout,
            wait_for_ready,
        )

    async def get_prefetch_status(
        self,
        request: storage_pb2.GetPrefetchStatusRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.GetPrefetchStatusResponse:
        """``GetPrefetchStatus``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "GetPrefetchStatus",
            request,
            storage_pb2.GetPrefetchStatusResponse,
            timeout,
            wait_for_ready,
        )

    async def release_prefetch(
        self,
        request: storage_pb2.ReleasePrefetchRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.ReleasePrefetchResponse:
        """``ReleasePrefetch``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "ReleasePrefetch",
            request,
            storage_pb2.ReleasePrefetchResponse,
            timeout,
            wait_for_ready,
        )

    async def release_lease(
        self,
        request: storage_pb2.ReleaseLeaseRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.ReleaseLeaseResponse:
        """``ReleaseLease``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "ReleaseLease", request, storage_pb2.ReleaseLeaseResponse, timeout, wait_for_ready
        )

    async def end_owner_leases(
        self,
        request: storage_pb2.EndOwnerLeasesRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.EndOwnerLeasesResponse:
        """``EndOwnerLeases``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "EndOwnerLeases", request, storage_pb2.EndOwnerLeasesResponse, timeout, wait_for_ready
        )

    async def retrieve_chunks(
        self,
        request: storage_pb2.RetrieveChunksRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.RetrieveChunksResponse:
        """``RetrieveChunks``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "RetrieveChunks",
            request,
            storage_pb2.RetrieveChunksResponse,
            timeout,
            wait_for_ready,
        )

    async def store_segment(
        self,
        request: storage_pb2.StoreSegmentRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.StoreSegmentResponse:
        """``StoreSegment``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "StoreSegment", request, storage_pb2.StoreSegmentResponse, timeout, wait_for_ready
        )

    async def retrieve_segment(
        self,
        request: storage_pb2.RetrieveSegmentRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.RetrieveSegmentResponse:
        """``RetrieveSegment``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "RetrieveSegment", request, storage_pb2.RetrieveSegmentResponse, timeout,
            wait_for_ready,
        )  # fmt: skip

    async def find_segments(
        self,
        request: storage_pb2.FindSegmentsRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.FindSegmentsResponse:
        """``FindSegments``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "FindSegments", request, storage_pb2.FindSegmentsResponse, timeout, wait_for_ready
        )

    async def release_locks(
        self,
        request: storage_pb2.ReleaseLocksRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.ReleaseLocksResponse:
        """``ReleaseLocks``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "ReleaseLocks",
            request,
            storage_pb2.ReleaseLocksResponse,
            timeout,
            wait_for_ready,
        )

    async def touch_keys(
        self,
        request: storage_pb2.TouchKeysRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.TouchKeysResponse:
        """``TouchKeys``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "TouchKeys",
            request,
            storage_pb2.TouchKeysResponse,
            timeout,
            wait_for_ready,
        )

    async def delete_keys(
        self,
        request: storage_pb2.DeleteKeysRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.DeleteKeysResponse:
        """``DeleteKeys``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "DeleteKeys",
            request,
            storage_pb2.DeleteKeysResponse,
            timeout,
            wait_for_ready,
        )

    async def clear(
        self,
        request: storage_pb2.ClearRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.ClearResponse:
        """``Clear``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "Clear", request, storage_pb2.ClearResponse, timeout, wait_for_ready
        )

    async def get_status(
        self,
        request: storage_pb2.GetStatusRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.GetStatusResponse:
        """``GetStatus``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "GetStatus",
            request,
            storage_pb2.GetStatusResponse,
            timeout,
            wait_for_ready,
        )

    async def list_objects(
        self,
        request: storage_pb2.ListObjectsRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.ListObjectsResponse:
        """``ListObjects``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "ListObjects",
            request,
            storage_pb2.ListObjectsResponse,
            timeout,
            wait_for_ready,
        )

    async def set_quota(
        self,
        request: storage_pb2.SetQuotaRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.SetQuotaResponse:
        """``SetQuota``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "SetQuota",
            request,
            storage_pb2.SetQuotaResponse,
            timeout,
            wait_for_ready,
        )

    async def get_quota(
        self,
        request: storage_pb2.GetQuotaRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.GetQuotaResponse:
        """``GetQuota``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "GetQuota",
            request,
            storage_pb2.GetQuotaResponse,
            timeout,
            wait_for_ready,
        )

    async def delete_quota(
        self,
        request: storage_pb2.DeleteQuotaRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.DeleteQuotaResponse:
        """``DeleteQuota``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "DeleteQuota",
            request,
            storage_pb2.DeleteQuotaResponse,
            timeout,
            wait_for_ready,
        )

    async def list_quotas(
        self,
        request: storage_pb2.ListQuotasRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.ListQuotasResponse:
        """``ListQuotas``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "ListQuotas",
            request,
            storage_pb2.ListQuotasResponse,
            timeout,
            wait_for_ready,
        )

    async def prepare_store(
        self,
        request: storage_pb2.PrepareStoreRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.PrepareStoreResponse:
        """``PrepareStore``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "PrepareStore",
            request,
            storage_pb2.PrepareStoreResponse,
            timeout,
            wait_for_ready,
        )

    async def commit_store(
        self,
        request: storage_pb2.CommitStoreRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.CommitStoreResponse:
        """``CommitStore``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "CommitStore",
            request,
            storage_pb2.CommitStoreResponse,
            timeout,
            wait_for_ready,
        )

    async def prepare_retrieve(
        self,
        request: storage_pb2.PrepareRetrieveRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.PrepareRetrieveResponse:
        """``PrepareRetrieve``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "PrepareRetrieve",
            request,
            storage_pb2.PrepareRetrieveResponse,
            timeout,
            wait_for_ready,
        )

    async def commit_retrieve(
        self,
        request: storage_pb2.CommitRetrieveRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> storage_pb2.CommitRetrieveResponse:
        """``CommitRetrieve``: see its comment in the .proto for semantics and errors."""
        return await self._call(
            "CommitRetrieve",
            request,
            storage_pb2.CommitRetrieveResponse,
            timeout,
            wait_for_ready,
        )
