"""``kvmesh.storage.v1.StorageService``: a thin adapter from protobuf to the StorageNode."""

from __future__ import annotations

from typing import Any

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2, storage_pb2_grpc
from kvmesh.common import layer_range
from kvmesh.common.convert import key_from_proto, key_to_proto
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage import wire
from kvmesh.storage.core.node import StorageNode

MAX_PAGE_SIZE = 10_000


class StorageServicer(storage_pb2_grpc.StorageServiceServicer):
    """Every RPC converts its request, calls the node, converts the answer."""

    def __init__(self, node: StorageNode, instance_id: str, incarnation: int) -> None:
        self.node = node
        self.instance_id = instance_id
        self.incarnation = incarnation
        self.emitter_status: Any = None  # set by the app when an emitter runs
        self.peer_status: Any = None  # set by the app: P2P counters (a PeerStatus)

    async def RegisterEngineMemory(
        self, request: storage_pb2.RegisterEngineMemoryRequest, context: Any
    ) -> storage_pb2.RegisterEngineMemoryResponse:
        await self.node.load_copies()  # torch, at the first registration: off the event loop
        layout = wire.layout_from_proto(request.layout)
        handles = [wire.handle_from_proto(h, i) for i, h in enumerate(request.layers)]
        already = self.node.register_engine(request.engine_id, layout, handles)
        return storage_pb2.RegisterEngineMemoryResponse(
            already_registered=already, instance_id=self.instance_id
        )

    async def UnregisterEngineMemory(
        self, request: storage_pb2.UnregisterEngineMemoryRequest, context: Any
    ) -> storage_pb2.UnregisterEngineMemoryResponse:
        existed = self.node.unregister_engine(request.engine_id)
        return storage_pb2.UnregisterEngineMemoryResponse(existed=existed)

    async def StoreChunks(
        self, request: storage_pb2.StoreChunksRequest, context: Any
    ) -> storage_pb2.StoreChunksResponse:
        outcomes = await self.node.store_chunks(
            request.engine_id,
            wire.row_keys(request.keys),
            request.block_ids,
            request.chunk_tokens,
            request.producer_event_handle,
        )
        return storage_pb2.StoreChunksResponse(
            outcomes=[storage_pb2.StoreOutcome.ValueType(o) for o in outcomes]
        )

    async def LookupAndLock(
        self, request: storage_pb2.LookupAndLockRequest, context: Any
    ) -> storage_pb2.LookupAndLockResponse:
        status = await self.node.lookup_and_lock(
            request.request_id,
            wire.grid_rows(request.keys),
            request.num_kv_readers,
            request.wait_timeout_ms,
            request.chunk_bytes,
            owner=request.owner,
        )
        completed, result = wire.prefetch_result(status)
        return storage_pb2.LookupAndLockResponse(
            prefetch_id=status.prefetch_id, completed=completed, result=result
        )

    async def GetPrefetchStatus(
        self, request: storage_pb2.GetPrefetchStatusRequest, context: Any
    ) -> storage_pb2.GetPrefetchStatusResponse:
        status = await self.node.prefetch_status(request.prefetch_id, request.wait_timeout_ms)
        completed, result = wire.prefetch_result(status)
        return storage_pb2.GetPrefetchStatusResponse(completed=completed, result=result)

    async def ReleasePrefetch(
        self, request: storage_pb2.ReleasePrefetchRequest, context: Any
    ) -> storage_pb2.ReleasePrefetchResponse:
        existed = self.node.release_prefetch(request.prefetch_id)
        return storage_pb2.ReleasePrefetchResponse(existed=existed)

    async def ReleaseLease(
        self, request: storage_pb2.ReleaseLeaseRequest, context: Any
    ) -> storage_pb2.ReleaseLeaseResponse:
        lookups = self.node.lookups
        if request.end:
            existed, released = lookups.end_lease(request.lease_id)
        else:
            if request.end_chunk < request.start_chunk:
                raise InvalidArgument(
                    f"end_chunk {request.end_chunk} < start_chunk {request.start_chunk}",
                    field="end_chunk",
                )
            existed = request.lease_id in lookups.leases.ids()
            released = lookups.leases.release(
                request.lease_id, request.start_chunk, request.end_chunk
            )
        return storage_pb2.ReleaseLeaseResponse(existed=existed, released_locks=released)

    async def EndOwnerLeases(
        self, request: storage_pb2.EndOwnerLeasesRequest, context: Any
    ) -> storage_pb2.EndOwnerLeasesResponse:
        if not request.owner:
            raise InvalidArgument("owner must not be empty", field="owner")
        return storage_pb2.EndOwnerLeasesResponse(
            ended_leases=self.node.lookups.end_owner(request.owner)
        )

    async def RetrieveChunks(
        self, request: storage_pb2.RetrieveChunksRequest, context: Any
    ) -> storage_pb2.RetrieveChunksResponse:
        retrieved = await self.node.retrieve_chunks(
            request.engine_id,
            wire.row_keys(request.keys),
            request.block_ids,
            request.chunk_tokens,
            request.skip_first_n_tokens,
            request.lease_id,
            request.producer_event_handle,
            layer_range.from_request(request),
        )
        return storage_pb2.RetrieveChunksResponse(retrieved_chunks=retrieved)

    async def StoreSegment(
        self, request: storage_pb2.StoreSegmentRequest, context: Any
    ) -> storage_pb2.StoreSegmentResponse:
        outcome = await self.node.segments.store(
            *wire.segment_placement(request.segment), request.segment.token_ids
        )
        return storage_pb2.StoreSegmentResponse(outcome=storage_pb2.StoreOutcome.ValueType(outcome))

    async def RetrieveSegment(
        self, request: storage_pb2.RetrieveSegmentRequest, context: Any
    ) -> storage_pb2.RetrieveSegmentResponse:
        found = await self.node.segments.retrieve(*wire.segment_placement(request.segment))
        return storage_pb2.RetrieveSegmentResponse(found=found)

    async def FindSegments(
        self, request: storage_pb2.FindSegmentsRequest, context: Any
    ) -> storage_pb2.FindSegmentsResponse:
        like = ObjectKey(b"", request.model_name, request.kv_rank, request.object_group_id,
                         request.cache_salt)  # fmt: skip
        matches, probed = await self.node.segments.find_in_fleet(
            like, request.token_ids, request.stride
        )
        return storage_pb2.FindSegmentsResponse(
            matches=[
                storage_pb2.FoundSegment(
                    start_token=start, num_tokens=n, chunk_hash=key.chunk_hash, on_this_node=here
                )
                for start, n, key, here in matches
            ],
            probed_positions=probed,
        )

    async def ReleaseLocks(
        self, request: storage_pb2.ReleaseLocksRequest, context: Any
    ) -> storage_pb2.ReleaseLocksResponse:
        keys = [k for row in wire.grid_rows(request.keys) for k in row]
        released, skipped = self.node.release_locks(keys, request.count)
        return storage_pb2.ReleaseLocksResponse(released_keys=released, skipped_keys=skipped)

    async def TouchKeys(
        self, request: storage_pb2.TouchKeysRequest, context: Any
    ) -> storage_pb2.TouchKeysResponse:
        keys = [k for row in wire.grid_rows(request.keys) for k in row]
        return storage_pb2.TouchKeysResponse(touched_keys=self.node.touch(keys))

    async def DeleteKeys(
        self, request: storage_pb2.DeleteKeysRequest, context: Any
    ) -> storage_pb2.DeleteKeysResponse:
        tier = wire.tier_of(request.tier, allow_all=True)
        keys = [key_from_proto(k) for k in request.keys]
        deleted, skipped = self.node.delete(keys, tier, request.backend, request.force)
        return storage_pb2.DeleteKeysResponse(deleted=deleted, skipped=skipped)

    async def Clear(
        self, request: storage_pb2.ClearRequest, context: Any
    ) -> storage_pb2.ClearResponse:
        return storage_pb2.ClearResponse(cleared_objects=await self.node.clear(request.force))

    async def GetStatus(
        self, request: storage_pb2.GetStatusRequest, context: Any
    ) -> storage_pb2.GetStatusResponse:
        data = self.node.status()
        l1 = data["l1"]
        response = storage_pb2.GetStatusResponse(
            instance_id=self.instance_id,
            incarnation=self.incarnation,
            l1=storage_pb2.L1Status(
                used_bytes=int(l1.get("used_bytes", 0)),
                mapped_bytes=int(l1.get("committed_bytes", 0)),
                configured_bytes=int(l1.get("capacity_bytes", 0)),
                resident_objects=int(l1.get("resident_objects", 0)),
                staging_objects=int(l1.get("staging_objects", 0)),
                read_locked_objects=int(l1.get("read_locked_objects", 0)),
                evicted_objects=int(data.get("eviction", {}).get("l1_evicted_keys", 0)),
            ),
            engine_ids=data["engines"],
            active_prefetches=int(data["active_prefetches"]),
            leases=storage_pb2.LeaseStatus(
                active=int(data["lookup_leases"]),
                held_locks=int(data["lease_locks"]),
                granted=data["lease_stats"].granted,
                ended=data["lease_stats"].ended,
                expired=data["lease_stats"].expired,
                ended_by_owner=data["lease_stats"].ended_by_owner,
            ),
        )
        for tier in data["l2"]:
            response.l2.append(
                storage_pb2.L2AdapterStatus(
                    backend=tier["backend"],
                    shared=tier["shared"],
                    healthy=tier["healthy"],
                    used_bytes=int(tier["index_bytes"]),
                    capacity_bytes=int(tier["declared_capacity_bytes"]),
                    object_count=int(tier["index_objects"]),
                    last_error=tier["last_error"] or "",
                    pending_stores=int(data["store"].get("pending_keys", 0)),
                )
            )
        for salt, used in sorted(self.node.manager.l1.bytes_by_salt().items()):
            quota = self.node.manager.get_quota(salt)
            usage = storage_pb2.SaltUsage(cache_salt=salt, tier=common_pb2.TIER_L1, used_bytes=used)
            if quota is not None and quota.l1_bytes is not None:
                usage.limit_bytes = quota.l1_bytes
            response.salts.append(usage)
        if self.emitter_status is not None:
            response.emitter.CopyFrom(self.emitter_status())
        if self.peer_status is not None:
            response.p2p.CopyFrom(self.peer_status())
        return response

    async def ListObjects(
        self, request: storage_pb2.ListObjectsRequest, context: Any
    ) -> storage_pb2.ListObjectsResponse:
        tier = wire.tier_of(request.tier, allow_all=True)
        page_size = request.page_size or 500
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size must be <= {MAX_PAGE_SIZE}", field="page_size")
        try:
            offset = int(request.page_token or "0")
        except ValueError:
            raise InvalidArgument(
                "page_token is not one this server issued", field="page_token"
            ) from None
        if offset < 0:
            raise InvalidArgument(
                "page_token is not one this server issued", field="page_token"
            ) from None
        listing = self.node.list_objects(tier, request.backend, request.model_name)
        page = listing[offset : offset + page_size]
        response = storage_pb2.ListObjectsResponse(
            objects=[
                storage_pb2.StoredObject(
                    key=key_to_proto(key),
                    tier=common_pb2.TIER_L1 if t is Tier.L1 else common_pb2.TIER_L2,
                    backend=backend,
                    size_bytes=size,
                )
                for key, t, backend, size in page
            ]
        )
        if offset + page_size < len(listing):
            response.next_page_token = str(offset + page_size)
        return response

    async def SetQuota(
        self, request: storage_pb2.SetQuotaRequest, context: Any
    ) -> storage_pb2.SetQuotaResponse:
        tier = wire.tier_of(request.tier, allow_all=False)
        assert tier is not None
        self.node.check_salt(request.cache_salt)
        self.node.apply_quota(request.cache_salt, tier, request.limit_bytes)
        return storage_pb2.SetQuotaResponse()

    async def GetQuota(
        self, request: storage_pb2.GetQuotaRequest, context: Any
    ) -> storage_pb2.GetQuotaResponse:
        tier = wire.tier_of(request.tier, allow_all=False)
        assert tier is not None
        self.node.check_salt(request.cache_salt)
        return storage_pb2.GetQuotaResponse(usage=self._salt_usage(request.cache_salt, tier))

    def _salt_usage(self, salt: str, tier: Tier) -> storage_pb2.SaltUsage:
        used, limit = self.node.salt_usage(salt, tier)
        usage = storage_pb2.SaltUsage(
            cache_salt=salt,
            tier=common_pb2.TIER_L1 if tier is Tier.L1 else common_pb2.TIER_L2,
            used_bytes=used,
        )
        if limit is not None:
            usage.limit_bytes = limit
        return usage

    async def DeleteQuota(
        self, request: storage_pb2.DeleteQuotaRequest, context: Any
    ) -> storage_pb2.DeleteQuotaResponse:
        tier = wire.tier_of(request.tier, allow_all=False)
        assert tier is not None
        self.node.check_salt(request.cache_salt)
        _, limit = self.node.salt_usage(request.cache_salt, tier)
        if limit is not None:
            self.node.apply_quota(request.cache_salt, tier, None)
        return storage_pb2.DeleteQuotaResponse(existed=limit is not None)

    async def ListQuotas(
        self, request: storage_pb2.ListQuotasRequest, context: Any
    ) -> storage_pb2.ListQuotasResponse:
        tier = wire.tier_of(request.tier, allow_all=False)
        assert tier is not None
        salts = self.node.salts(tier)
        return storage_pb2.ListQuotasResponse(salts=[self._salt_usage(s, tier) for s in salts])

    async def PrepareStore(
        self, request: storage_pb2.PrepareStoreRequest, context: Any
    ) -> storage_pb2.PrepareStoreResponse:
        keys = wire.row_keys(request.keys)
        # Growing L1 for these slots happens off the event loop (it maps memory).
        await self.node.manager.make_room([request.chunk_bytes] * len(keys))
        txn, slots, cached, skipped = self.node.prepare_store(
            keys, request.chunk_bytes, request.segment_token_ids
        )
        return storage_pb2.PrepareStoreResponse(
            transaction_id=txn,
            slots=[wire.slot_to_proto(s) for s in slots],
            already_cached_chunks=cached,
            skipped_chunks=skipped,
        )

    async def CommitStore(
        self, request: storage_pb2.CommitStoreRequest, context: Any
    ) -> storage_pb2.CommitStoreResponse:
        committed = self.node.commit_store(request.transaction_id)
        return storage_pb2.CommitStoreResponse(committed_chunks=committed)

    async def PrepareRetrieve(
        self, request: storage_pb2.PrepareRetrieveRequest, context: Any
    ) -> storage_pb2.PrepareRetrieveResponse:
        txn, slots = self.node.prepare_retrieve(wire.row_keys(request.keys), request.chunk_bytes)
        return storage_pb2.PrepareRetrieveResponse(
            transaction_id=txn, slots=[wire.slot_to_proto(s) for s in slots]
        )

    async def CommitRetrieve(
        self, request: storage_pb2.CommitRetrieveRequest, context: Any
    ) -> storage_pb2.CommitRetrieveResponse:
        released = self.node.commit_retrieve(request.transaction_id, request.lease_id)
        return storage_pb2.CommitRetrieveResponse(released_chunks=released)
