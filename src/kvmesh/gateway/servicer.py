"""``kvmesh.gateway.v1.GatewayService``: dispatch from RPCs to the Gateway core.

Every RPC converts its request with ``wire``, calls the core, and converts
the answer back; errors are the core's (or storage's, relayed unchanged),
turned into status codes by the chassis.
"""

from __future__ import annotations

from typing import Any

from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.common import layer_range
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.node_types import StoreOutcome
from kvmesh.gateway import wire
from kvmesh.gateway.core import Gateway


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """One method per RPC: convert, call the core, convert."""

    def __init__(self, core: Gateway) -> None:
        self.core = core

    async def RegisterKVCache(
        self, request: gateway_pb2.RegisterKVCacheRequest, context: Any
    ) -> gateway_pb2.RegisterKVCacheResponse:
        forward = wire.memory_registration(request)
        already = await self.core.register_kv_cache(
            wire.engine_spec(request),
            forward,
            wire.layout_fingerprint(request),
            chunk_bytes=wire.chunk_bytes(request.layout, self.core.chunk_size),
            num_layers=request.layout.num_layers,
            host_memory=wire.host_memory(request),
            kv_format=wire.kv_format(request.layout),
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
            wire.tokens(request.token_ids),
            request.end_token,
            request.num_kv_readers,
            request.wait_timeout_ms,
            request.engine_id,
        )
        return gateway_pb2.LookupResponse(
            status=wire.prefetch_status(status), requested_chunks=requested
        )

    async def QueryPrefetchStatus(
        self, request: gateway_pb2.QueryPrefetchStatusRequest, context: Any
    ) -> gateway_pb2.QueryPrefetchStatusResponse:
        status = await self.core.query_prefetch_status(request.request_id)
        return gateway_pb2.QueryPrefetchStatusResponse(status=wire.prefetch_status(status))

    async def WaitPrefetchStatus(
        self, request: gateway_pb2.WaitPrefetchStatusRequest, context: Any
    ) -> gateway_pb2.WaitPrefetchStatusResponse:
        status = await self.core.wait_prefetch_status(request.request_id, request.timeout_ms)
        return gateway_pb2.WaitPrefetchStatusResponse(status=wire.prefetch_status(status))

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
        result = await self.core.store(
            request.engine_id,
            wire.prompt_range(request.range),
            request.block_ids,
            request.producer_event_handle,
        )
        return gateway_pb2.StoreResponse(
            stored_chunks=result.stored_chunks,
            already_cached_chunks=result.already_cached_chunks,
            skipped_chunks=result.skipped_chunks,
        )

    async def Retrieve(
        self, request: gateway_pb2.RetrieveRequest, context: Any
    ) -> gateway_pb2.RetrieveResponse:
        chunks = await self.core.retrieve(
            request.engine_id,
            wire.prompt_range(request.range),
            request.block_ids,
            request.skip_first_n_tokens,
            request.producer_event_handle,
            layer_range.from_request(request),
        )
        return gateway_pb2.RetrieveResponse(
            retrieved_chunks=chunks, retrieved_tokens=chunks * self.core.chunk_size
        )

    async def RetrieveAhead(
        self, request: gateway_pb2.RetrieveRequest, context: Any
    ) -> gateway_pb2.RetrieveAheadResponse:
        if request.HasField("layers"):
            raise InvalidArgument(
                "RetrieveAhead starts whole loads; layers must be unset", field="layers"
            )
        started = await self.core.retrieve_ahead(
            request.engine_id,
            wire.prompt_range(request.range),
            request.block_ids,
            request.skip_first_n_tokens,
        )
        return gateway_pb2.RetrieveAheadResponse(started=started)

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
        shape, already = self.core.register_engine_context(
            wire.engine_spec(request),
            layout.num_layers,
            layout.kv_heads,
            layout.head_dim,
            wire.itemsize(layout),
            layout.use_mla,
            kv_format=wire.kv_format(layout),
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
        prepared = await self.core.prepare_store(
            request.engine_id, wire.prompt_range(request.range)
        )
        return gateway_pb2.PrepareStoreResponse(
            transaction_id=prepared.transaction_id,
            slots=[wire.chunk_slot(s) for s in prepared.slots],
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
        prepared = await self.core.prepare_retrieve(
            request.engine_id, wire.prompt_range(request.range)
        )
        return gateway_pb2.PrepareRetrieveResponse(
            transaction_id=prepared.transaction_id,
            slots=[wire.chunk_slot(s) for s in prepared.slots],
        )

    async def PrepareSegmentStore(
        self, request: gateway_pb2.PrepareSegmentStoreRequest, context: Any
    ) -> gateway_pb2.PrepareSegmentStoreResponse:
        slot = await self.core.prepare_segment_store(
            request.engine_id, request.cache_salt, wire.tokens(request.token_ids)
        )
        return gateway_pb2.PrepareSegmentStoreResponse(
            transaction_id=slot.transaction_id,
            region=wire.segment_region(slot),
            already_cached=slot.already_cached,
            segment_bytes=slot.segment_bytes,
        )

    async def PrepareSegmentRetrieve(
        self, request: gateway_pb2.PrepareSegmentRetrieveRequest, context: Any
    ) -> gateway_pb2.PrepareSegmentRetrieveResponse:
        slot = await self.core.prepare_segment_retrieve(
            request.engine_id, request.cache_salt, wire.tokens(request.token_ids)
        )
        return gateway_pb2.PrepareSegmentRetrieveResponse(
            transaction_id=slot.transaction_id,
            region=wire.segment_region(slot),
            segment_bytes=slot.segment_bytes,
        )

    async def LookupSegments(
        self, request: gateway_pb2.LookupSegmentsRequest, context: Any
    ) -> gateway_pb2.LookupSegmentsResponse:
        matches, probed = await self.core.lookup_segments(
            request.engine_id, request.cache_salt, wire.tokens(request.token_ids), request.stride
        )
        prefix = 0
        for start, length in matches:
            if start != prefix:
                break
            prefix += length
        return gateway_pb2.LookupSegmentsResponse(
            matches=[
                gateway_pb2.SegmentMatch(start_token=start, num_tokens=length)
                for start, length in matches
            ],
            probed_positions=probed,
            prefix_tokens=prefix,
        )

    async def StoreSegment(
        self, request: gateway_pb2.StoreSegmentRequest, context: Any
    ) -> gateway_pb2.StoreSegmentResponse:
        s = request.segment
        outcome = await self.core.store_segment(
            s.engine_id, s.cache_salt, wire.tokens(s.token_ids), s.block_ids, s.start_token
        )
        return gateway_pb2.StoreSegmentResponse(
            stored=outcome is StoreOutcome.STORED,
            already_cached=outcome is StoreOutcome.ALREADY_CACHED,
        )

    async def RetrieveSegment(
        self, request: gateway_pb2.RetrieveSegmentRequest, context: Any
    ) -> gateway_pb2.RetrieveSegmentResponse:
        s = request.segment
        found = await self.core.retrieve_segment(
            s.engine_id, s.cache_salt, wire.tokens(s.token_ids), s.block_ids, s.start_token
        )
        return gateway_pb2.RetrieveSegmentResponse(found=found)

    async def CommitRetrieve(
        self, request: gateway_pb2.CommitRetrieveRequest, context: Any
    ) -> gateway_pb2.CommitRetrieveResponse:
        released = await self.core.commit_retrieve(request.engine_id, request.transaction_id)
        return gateway_pb2.CommitRetrieveResponse(released_chunks=released)
