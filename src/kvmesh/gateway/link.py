"""The gateway's link to its node's storage service: NodeStorage over gRPC.

Converts the core's plain types to ``kvmesh.storage.v1`` messages and back.
A storage failure surfaces as the gRPC error it was (UNAVAILABLE when the
node is down, INVALID_ARGUMENT for a block id out of range, ...): the
gateway's servicer passes it through unchanged so engines see storage's
clear message.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.common.deadlines import remaining
from kvmesh.common.node_types import PrefetchState, Slot, StoreOutcome
from kvmesh.gateway.core.node_storage import KeyGridSpec, KeyRow, PreparedSlots
from kvmesh.storage.client import StorageClient


def _caller_deadline() -> float | None:
    """What is left of the engine's deadline: storage's copies honour it too (a copy
    never starts when the engine is about to give up; see kvmesh.common.deadlines)."""
    left = remaining()
    return None if left is None else max(left, 0.001)


def _placement(
    engine_id: str,
    row: KeyRow,
    block_ids: Sequence[int],
    start_token: int,
    num_tokens: int,
    tokens: Sequence[int] | np.ndarray = (),
) -> storage_pb2.SegmentPlacement:
    """The storage placement of the one segment key of ``row``."""
    (chunk_hash,) = row.chunk_hashes
    return storage_pb2.SegmentPlacement(
        engine_id=engine_id,
        key=common_pb2.ObjectKey(
            chunk_hash=chunk_hash,
            model_name=row.model_name,
            kv_rank=row.kv_rank,
            cache_salt=row.cache_salt,
        ),
        block_ids=block_ids,
        start_token=start_token,
        num_tokens=num_tokens,
        token_ids=tokens,
    )


def _row(row: KeyRow) -> common_pb2.ChunkKeys:
    return common_pb2.ChunkKeys(
        model_name=row.model_name,
        cache_salt=row.cache_salt,
        kv_rank=row.kv_rank,
        chunk_hashes=row.chunk_hashes,
    )


def _grid(grid: KeyGridSpec) -> common_pb2.KeyGrid:
    return common_pb2.KeyGrid(
        model_name=grid.model_name,
        cache_salt=grid.cache_salt,
        kv_ranks=grid.kv_ranks,
        chunk_hashes=grid.chunk_hashes,
    )


def _state(prefetch_id: str, completed: bool, result: storage_pb2.PrefetchResult) -> PrefetchState:
    return PrefetchState(
        prefetch_id,
        completed,
        result.hit_chunks,
        result.l1_hit_chunks,
        result.l2_hit_chunks,
        result.lease_ttl_ms,
    )


def _prepared(
    transaction_id: str, slots: Sequence[storage_pb2.Slot], cached: int = 0, skipped: int = 0
) -> PreparedSlots:
    refs = [
        Slot(s.chunk_index, s.region.path, s.region.offset_bytes, s.region.size_bytes)
        for s in slots
    ]
    return PreparedSlots(transaction_id, refs, cached, skipped)


class GrpcNodeStorage:
    """NodeStorage implemented with the asyncio StorageClient."""

    # A remote node finishes a call whatever the caller does: shield it.
    cancel_safe = False

    def __init__(self, client: StorageClient) -> None:
        self.client = client

    async def register_engine(self, engine_id: str, registration: object) -> tuple[bool, str]:
        assert isinstance(registration, storage_pb2.RegisterEngineMemoryRequest)
        response = await self.client.register_engine_memory(registration)
        return response.already_registered, response.instance_id

    async def unregister_engine(self, engine_id: str) -> bool:
        response = await self.client.unregister_engine_memory(
            storage_pb2.UnregisterEngineMemoryRequest(engine_id=engine_id)
        )
        return response.existed

    async def lookup_and_lock(
        self, request_id: str, grid: KeyGridSpec, readers: int, wait_ms: int, owner: str
    ) -> PrefetchState:
        response = await self.client.lookup_and_lock(
            storage_pb2.LookupAndLockRequest(
                keys=_grid(grid),
                num_kv_readers=readers,
                wait_timeout_ms=wait_ms,
                request_id=request_id,
                chunk_bytes=grid.chunk_bytes,
                owner=owner,
            )
        )
        return _state(response.prefetch_id, response.completed, response.result)

    async def prefetch_status(self, prefetch_id: str, wait_ms: int) -> PrefetchState:
        response = await self.client.get_prefetch_status(
            storage_pb2.GetPrefetchStatusRequest(prefetch_id=prefetch_id, wait_timeout_ms=wait_ms)
        )
        return _state(prefetch_id, response.completed, response.result)

    async def end_lease(self, lease_id: str) -> int:
        response = await self.client.release_lease(
            storage_pb2.ReleaseLeaseRequest(lease_id=lease_id, end=True)
        )
        return response.released_locks

    async def release_lease(self, lease_id: str, first_chunk: int, last_chunk: int) -> int:
        response = await self.client.release_lease(
            storage_pb2.ReleaseLeaseRequest(
                lease_id=lease_id, start_chunk=first_chunk, end_chunk=last_chunk
            )
        )
        return response.released_locks

    async def end_owner_leases(self, owner: str) -> int:
        response = await self.client.end_owner_leases(
            storage_pb2.EndOwnerLeasesRequest(owner=owner)
        )
        return response.ended_leases

    async def store_chunks(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        chunk_tokens: int,
        producer_event: bytes = b"",
    ) -> list[StoreOutcome]:
        response = await self.client.store_chunks(
            storage_pb2.StoreChunksRequest(
                engine_id=engine_id,
                keys=_row(row),
                block_ids=block_ids,
                chunk_tokens=chunk_tokens,
                producer_event_handle=producer_event,
            ),
            timeout=_caller_deadline(),
        )
        return [StoreOutcome(o) for o in response.outcomes]

    async def retrieve_chunks(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        chunk_tokens: int,
        skip_first_n_tokens: int,
        lease_id: str,
        producer_event: bytes = b"",
        layers: tuple[int, int] | None = None,
    ) -> int:
        request = storage_pb2.RetrieveChunksRequest(
            engine_id=engine_id,
            keys=_row(row),
            block_ids=block_ids,
            chunk_tokens=chunk_tokens,
            skip_first_n_tokens=skip_first_n_tokens,
            lease_id=lease_id,
            producer_event_handle=producer_event,
        )
        if layers is not None:
            request.layers.start, request.layers.end = layers
        response = await self.client.retrieve_chunks(request, timeout=_caller_deadline())
        return response.retrieved_chunks

    async def touch(self, grid: KeyGridSpec) -> None:
        await self.client.touch_keys(storage_pb2.TouchKeysRequest(keys=_grid(grid)))

    async def clear(self, force: bool) -> int:
        response = await self.client.clear(storage_pb2.ClearRequest(force=force))
        return response.cleared_objects

    async def prepare_store(
        self, row: KeyRow, chunk_bytes: int, segment_tokens: Sequence[int] | np.ndarray = ()
    ) -> PreparedSlots:
        response = await self.client.prepare_store(
            storage_pb2.PrepareStoreRequest(
                keys=_row(row), chunk_bytes=chunk_bytes, segment_token_ids=segment_tokens
            )
        )
        return _prepared(
            response.transaction_id,
            response.slots,
            response.already_cached_chunks,
            response.skipped_chunks,
        )

    async def store_segment(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        start_token: int,
        tokens: Sequence[int] | np.ndarray,
    ) -> StoreOutcome:
        response = await self.client.store_segment(
            storage_pb2.StoreSegmentRequest(
                segment=_placement(engine_id, row, block_ids, start_token, len(tokens), tokens)
            ),
            timeout=_caller_deadline(),
        )
        return StoreOutcome(response.outcome)

    async def retrieve_segment(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        start_token: int,
        num_tokens: int,
    ) -> bool:
        response = await self.client.retrieve_segment(
            storage_pb2.RetrieveSegmentRequest(
                segment=_placement(engine_id, row, block_ids, start_token, num_tokens)
            ),
            timeout=_caller_deadline(),
        )
        return response.found

    async def find_segments(
        self, row: KeyRow, prompt: Sequence[int] | np.ndarray, stride: int
    ) -> tuple[list[tuple[int, int]], int]:
        response = await self.client.find_segments(
            storage_pb2.FindSegmentsRequest(
                model_name=row.model_name,
                cache_salt=row.cache_salt,
                kv_rank=row.kv_rank,
                token_ids=prompt,
                stride=stride,
            )
        )
        found = [(m.start_token, m.num_tokens) for m in response.matches]
        return found, response.probed_positions

    async def commit_store(self, transaction_id: str) -> int:
        response = await self.client.commit_store(
            storage_pb2.CommitStoreRequest(transaction_id=transaction_id)
        )
        return response.committed_chunks

    async def prepare_retrieve(self, row: KeyRow, chunk_bytes: int) -> PreparedSlots:
        response = await self.client.prepare_retrieve(
            storage_pb2.PrepareRetrieveRequest(keys=_row(row), chunk_bytes=chunk_bytes)
        )
        return _prepared(response.transaction_id, response.slots)

    async def commit_retrieve(self, transaction_id: str, lease_id: str) -> int:
        response = await self.client.commit_retrieve(
            storage_pb2.CommitRetrieveRequest(transaction_id=transaction_id, lease_id=lease_id)
        )
        return response.released_chunks
