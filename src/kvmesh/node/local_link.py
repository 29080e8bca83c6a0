"""NodeStorage in-process: the gateway calling its storage node directly (``kvmesh node``).

When a node's gateway and storage run in one process, every engine request
saves a whole gRPC round trip (serialisation, a socket, another event-loop
turn). The semantics are exactly those of the gRPC link: the same
StorageNode methods run, and errors are the same KvmeshError types.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.common.keys import ObjectKey
from kvmesh.common.node_types import PrefetchState, StoreOutcome
from kvmesh.gateway.core.node_storage import KeyGridSpec, KeyRow, PreparedSlots
from kvmesh.storage.core.node import StorageNode
from kvmesh.storage.wire import handle_from_proto, layout_from_proto


def _row_keys(row: KeyRow) -> list[ObjectKey]:
    return [ObjectKey(h, row.model_name, row.kv_rank, 0, row.cache_salt) for h in row.chunk_hashes]


def _grid_rows(grid: KeyGridSpec) -> list[list[ObjectKey]]:
    return [
        [ObjectKey(h, grid.model_name, rank, 0, grid.cache_salt) for h in grid.chunk_hashes]
        for rank in grid.kv_ranks
    ]


class LocalNodeStorage:
    """NodeStorage over a StorageNode in the same process."""

    # StorageNode.lookup_and_lock releases what a cancelled lookup locked, and
    # prefetch_status only forgets a result it has returned.
    cancel_safe = True

    def __init__(self, node: StorageNode, instance_id: str) -> None:
        self.node = node
        self.instance_id = instance_id

    async def register_engine(self, engine_id: str, registration: object) -> tuple[bool, str]:
        assert isinstance(registration, storage_pb2.RegisterEngineMemoryRequest)
        await self.node.load_copies()  # torch, at the first registration: off the event loop
        layout = layout_from_proto(registration.layout)
        handles = [handle_from_proto(h, i) for i, h in enumerate(registration.layers)]
        return self.node.register_engine(engine_id, layout, handles), self.instance_id

    async def unregister_engine(self, engine_id: str) -> bool:
        return self.node.unregister_engine(engine_id)

    async def lookup_and_lock(
        self, request_id: str, grid: KeyGridSpec, readers: int, wait_ms: int, owner: str
    ) -> PrefetchState:
        return await self.node.lookup_and_lock(
            request_id, _grid_rows(grid), readers, wait_ms, grid.chunk_bytes, owner=owner
        )

    async def prefetch_status(self, prefetch_id: str, wait_ms: int) -> PrefetchState:
        return await self.node.prefetch_status(prefetch_id, wait_ms)

    async def end_lease(self, lease_id: str) -> int:
        return self.node.lookups.end_lease(lease_id)[1]

    async def release_lease(self, lease_id: str, first_chunk: int, last_chunk: int) -> int:
        return self.node.lookups.leases.release(lease_id, first_chunk, last_chunk)

    async def end_owner_leases(self, owner: str) -> int:
        return self.node.lookups.end_owner(owner)

    async def store_chunks(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        chunk_tokens: int,
        producer_event: bytes = b"",
    ) -> list[StoreOutcome]:
        return await self.node.store_chunks(
            engine_id, _row_keys(row), block_ids, chunk_tokens, producer_event
        )

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
        return await self.node.retrieve_chunks(
            engine_id,
            _row_keys(row),
            block_ids,
            chunk_tokens,
            skip_first_n_tokens,
            lease_id,
            producer_event,
            layers,
        )

    async def touch(self, grid: KeyGridSpec) -> None:
        self.node.touch([k for row in _grid_rows(grid) for k in row])

    async def clear(self, force: bool) -> int:
        return await self.node.clear(force)

    async def prepare_store(
        self, row: KeyRow, chunk_bytes: int, segment_tokens: Sequence[int] | np.ndarray = ()
    ) -> PreparedSlots:
        txn, slots, cached, skipped = self.node.prepare_store(
            _row_keys(row), chunk_bytes, segment_tokens
        )
        return PreparedSlots(txn, slots, cached, skipped)

    async def store_segment(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        start_token: int,
        tokens: Sequence[int] | np.ndarray,
    ) -> StoreOutcome:
        (key,) = _row_keys(row)
        return await self.node.segments.store(
            engine_id, key, block_ids, start_token, len(tokens), tokens
        )

    async def retrieve_segment(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        start_token: int,
        num_tokens: int,
    ) -> bool:
        (key,) = _row_keys(row)
        return await self.node.segments.retrieve(engine_id, key, block_ids, start_token, num_tokens)

    async def find_segments(
        self, row: KeyRow, prompt: Sequence[int] | np.ndarray, stride: int
    ) -> tuple[list[tuple[int, int]], int]:
        like = ObjectKey(b"", row.model_name, row.kv_rank, 0, row.cache_salt)
        matches, probed = await self.node.segments.find_in_fleet(like, prompt, stride)
        return [(start, length) for start, length, _, _ in matches], probed

    async def commit_store(self, transaction_id: str) -> int:
        return self.node.commit_store(transaction_id)

    async def prepare_retrieve(self, row: KeyRow, chunk_bytes: int) -> PreparedSlots:
        txn, slots = self.node.prepare_retrieve(_row_keys(row), chunk_bytes)
        return PreparedSlots(txn, slots)

    async def commit_retrieve(self, transaction_id: str, lease_id: str) -> int:
        return self.node.commit_retrieve(transaction_id, lease_id)
