"""``kvmesh.gateway.v1.GatewayService``: a thin adapter from protobuf to the Gateway core."""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf import message as _message

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.common.errors import InvalidArgument
from kvmesh.gateway.core import EngineSpec, Gateway, PrefetchStatus, PromptRangeSpec

_ITEMSIZE = {
    common_pb2.DTYPE_FLOAT16: 2,
    common_pb2.DTYPE_BFLOAT16: 2,
    common_pb2.DTYPE_FLOAT32: 4,
    common_pb2.DTYPE_FLOAT8_E4M3FN: 1,
    common_pb2.DTYPE_FLOAT8_E5M2: 1,
    common_pb2.DTYPE_UINT8: 1,
}


def _tokens(values: Any) -> np.ndarray:
    # fixed32 repeated fields expose a buffer: this is a memory copy, not a loop.
    return np.array(values, dtype=np.uint32)


def _range(rng: gateway_pb2.PromptRange) -> PromptRangeSpec:
    return PromptRangeSpec(
        request_id=rng.request_id,
        model_name=rng.model_name,
        world_size=rng.world_size,
        cache_salt=rng.cache_salt,
        token_ids=_tokens(rng.token_ids),
        start_token=rng.start_token,
        end_token=rng.end_token,
    )


def _status(status: PrefetchStatus) -> gateway_pb2.PrefetchStatus:
    return gateway_pb2.PrefetchStatus(
        completed=status.completed,
        hit_chunks=status.hit_chunks,
        hit_tokens=status.hit_tokens,
        l1_hit_chunks=status.l1_hit_chunks,
        l2_hit_chunks=status.l2_hit_chunks,
    )


def _chunk_bytes(layout: common_pb2.KVLayout, chunk_size: int) -> int:
    """Bytes of one chunk object under ``layout`` (0 when the layout is incomplete)."""
    itemsize = _ITEMSIZE.get(layout.dtype, 0)
    planes = 1 if layout.kind == common_pb2.KV_LAYOUT_KIND_MLA else 2
    return planes * layout.num_layers * chunk_size * layout.kv_heads * layout.head_dim * itemsize


def _fingerprint(*messages: _message.Message) -> bytes:
    return b"|".join(m.SerializeToString(deterministic=True) for m in messages)


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """Every RPC converts its request, calls the core, converts the answer."""

    def __init__(self, core: Gateway) -> None:
        self.core = core

    async def RegisterKVCache(
        self, request: gateway_pb2.RegisterKVCacheRequest, context: Any
    ) -> gateway_pb2.RegisterKVCacheResponse:
        if not request.HasField("layout"):
            raise InvalidArgument("layout is required", field="layout")
        spec = EngineSpec(
            request.engine_id,
            request.model_name,
            request.world_size,
            request.worker_id,
            request.layout.block_size,
        )
        forward = storage_pb2.RegisterEngineMemoryRequest(
            engine_id=request.engine_id, layout=request.layout, layers=request.layers
        )
        already = await self.core.register_kv_cache(
            spec,
            forward,
            _fingerprint(request.layout, *request.layers),
            chunk_bytes=_chunk_bytes(request.layout, self.core.chunk_size),
        )
        return gateway_pb2.RegisterKVCacheResponse(
            chunk_size=self.core.chunk_size,
            storage_instance_id=self.core.storage_instance_id,
            already_registered=already,
        )

    async def UnregisterKVCache(
        self, request: gateway_pb2.UnregisterKVCacheRequest, context: Any
    ) -> gateway_pb2.UnregisterKVCacheResponse:
        existed = await self.core.unregister_kv_cache(request.engine_id)
        return gateway_pb2.UnregisterKVCacheResponse(existed=existed)

    async def Lookup(
        self, request: gateway_pb2.LookupRequest, context: Any
    ) -> gateway_pb2.LookupResponse:
        status, requested = await self.core.lookup(
            request.request_id,
            request.model_name,
            request.world_size,
            request.cache_salt,
            _tokens(request.token_ids),
            request.end_token,
            request.num_kv_readers,
            request.wait_timeout_ms,
        )
        return gateway_pb2.LookupResponse(status=_status(status), requested_chunks=requested)

    async def QueryPrefetchStatus(
        self, request: gateway_pb2.QueryPrefetchStatusRequest, context: Any
    ) -> gateway_pb2.QueryPrefetchStatusResponse:
        status = await self.core.query_prefetch_status(request.request_id)
        return gateway_pb2.QueryPrefetchStatusResponse(status=_status(status))

    async def WaitPrefetchStatus(
        self, request: gateway_pb2.WaitPrefetchStatusRequest, context: Any
    ) -> gateway_pb2.WaitPrefetchStatusResponse:
        status = await self.core.wait_prefetch_status(request.request_id, request.timeout_ms)
        return gateway_pb2.WaitPrefetchStatusResponse(status=_status(status))

    async def FreeLookupLocks(
        self, request: gateway_pb2.FreeLookupLocksRequest, context: Any
    ) -> gateway_pb2.FreeLookupLocksResponse:
        released = await self.core.free_lookup_locks(
            request.request_id, request.start_token, request.end_token
        )
        return gateway_pb2.FreeLookupLocksResponse(released_locks=released)

    async def EndSession(
        self, request: gateway_pb2.EndSessionRequest, context: Any
    ) -> gateway_pb2.EndSessionResponse:
        existed, released = await self.core.end_session(request.request_id)
        return gateway_pb2.EndSessionResponse(existed=existed, released_locks=released)

    async def Store(
        self, request: gateway_pb2.StoreRequest, context: Any
    ) -> gateway_pb2.StoreResponse:
        result = await self.core.store(request.engine_id, _range(request.range), request.block_ids)
        return gateway_pb2.StoreResponse(
            stored_chunks=result.stored_chunks,
            already_cached_chunks=result.already_cached_chunks,
            skipped_chunks=result.skipped_chunks,
        )

    async def Retrieve(
        self, request: gateway_pb2.RetrieveRequest, context: Any
    ) -> gateway_pb2.RetrieveResponse:
        chunks = await self.core.retrieve(
            request.engine_id, _range(request.range), request.block_ids, request.skip_first_n_tokens
        )
        return gateway_pb2.RetrieveResponse(
            retrieved_chunks=chunks, retrieved_tokens=chunks * self.core.chunk_size
        )

    async def Clear(
        self, request: gateway_pb2.ClearRequest, context: Any
    ) -> gateway_pb2.ClearResponse:
        cleared = await self.core.clear(request.force)
        return gateway_pb2.ClearResponse(cleared_objects=cleared)

    async def GetChunkSize(
        self, request: gateway_pb2.GetChunkSizeRequest, context: Any
    ) -> gateway_pb2.GetChunkSizeResponse:
        return gateway_pb2.GetChunkSizeResponse(chunk_size=self.core.chunk_size)

    async def Ping(
        self, request: gateway_pb2.PingRequest, context: Any
    ) -> gateway_pb2.PingResponse:
        return gateway_pb2.PingResponse(engine_known=self.core.ping(request.engine_id))

    async def ReportBlockAllocation(
        self, request: gateway_pb2.ReportBlockAllocationRequest, context: Any
    ) -> gateway_pb2.ReportBlockAllocationResponse:
        self.core.report_block_allocation(
            request.engine_id, [a.request_id for a in request.allocations]
        )
        return gateway_pb2.ReportBlockAllocationResponse()

    async def RegisterEngineContext(
        self, request: gateway_pb2.RegisterEngineContextRequest, context: Any
    ) -> gateway_pb2.RegisterEngineContextResponse:
        layout = request.layout
        itemsize = _ITEMSIZE.get(layout.dtype)
        if itemsize is None:
            raise InvalidArgument("layout.dtype must be specified", field="layout.dtype")
        spec = EngineSpec(
            request.engine_id,
            request.model_name,
            request.world_size,
            request.worker_id,
            layout.block_size,
        )
        shape, already = self.core.register_engine_context(
            spec, layout.num_layers, layout.kv_heads, layout.head_dim, itemsize, layout.use_mla
        )
        return gateway_pb2.RegisterEngineContextResponse(
            chunk_size=self.core.chunk_size,
            chunk_shape=shape,
            dtype=layout.dtype,
            already_registered=already,
        )

    async def UnregisterEngineContext(
        self, request: gateway_pb2.UnregisterEngineContextRequest, context: Any
    ) -> gateway_pb2.UnregisterEngineContextResponse:
        existed = self.core.unregister_engine_context(request.engine_id)
        return gateway_pb2.UnregisterEngineContextResponse(existed=existed)

    async def PrepareStore(
        self, request: gateway_pb2.PrepareStoreRequest, context: Any
    ) -> gateway_pb2.PrepareStoreResponse:
        prepared = await self.core.prepare_store(request.engine_id, _range(request.range))
        return gateway_pb2.PrepareStoreResponse(
            transaction_id=prepared.transaction_id,
            slots=[_slot(s) for s in prepared.slots],
            already_cached_chunks=prepared.already_cached_chunks,
            skipped_chunks=prepared.skipped_chunks,
        )

    async def CommitStore(
        self, request: gateway_pb2.CommitStoreRequest, context: Any
    ) -> gateway_pb2.CommitStoreResponse:
        committed = await self.core.commit_store(request.engine_id, request.transaction_id)
        return gateway_pb2.CommitStoreResponse(committed_chunks=committed)

    async def PrepareRetrieve(
        self, request: gateway_pb2.PrepareRetrieveRequest, context: Any
    ) -> gateway_pb2.PrepareRetrieveResponse:
        prepared = await self.core.prepare_retrieve(request.engine_id, _range(request.range))
        return gateway_pb2.PrepareRetrieveResponse(
            transaction_id=prepared.transaction_id, slots=[_slot(s) for s in prepared.slots]
        )

    async def CommitRetrieve(
        self, request: gateway_pb2.CommitRetrieveRequest, context: Any
    ) -> gateway_pb2.CommitRetrieveResponse:
        released = await self.core.commit_retrieve(request.engine_id, request.transaction_id)
        return gateway_pb2.CommitRetrieveResponse(released_chunks=released)


def _slot(slot: Any) -> gateway_pb2.ChunkSlot:
    return gateway_pb2.ChunkSlot(
        chunk_index=slot.chunk_index,
        region=common_pb2.SharedMemoryHandle(
            path=slot.path, offset_bytes=slot.offset_bytes, size_bytes=slot.size_bytes
        ),
    )
