"""The gateway's port to its node's storage service, and the plain types it speaks.

:class:`NodeStorage` is what every piece of the core calls; the adapters
above the core implement it (``kvmesh.gateway.link`` over gRPC,
``kvmesh.node.local_link`` in-process, an in-memory fake in the unit tests).
Nothing here knows protobuf or grpc.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvmesh.common.node_types import PrefetchState, Slot, StoreOutcome


@dataclass(frozen=True, slots=True)
class PreparedSlots:
    """Result of a prepare-store or prepare-retrieve on storage."""

    transaction_id: str
    slots: list[Slot]
    already_cached_chunks: int = 0
    skipped_chunks: int = 0


@dataclass(frozen=True, slots=True)
class KeyRow:
    """Consecutive chunks of one kv rank (``kvmesh.common.v1.ChunkKeys``)."""

    model_name: str
    cache_salt: str
    kv_rank: int
    chunk_hashes: Sequence[bytes]


@dataclass(frozen=True, slots=True)
class KeyGridSpec:
    """Every kv rank × every chunk (``kvmesh.common.v1.KeyGrid``).

    ``chunk_bytes`` (0 = unknown) is the size of one chunk object under the
    engines' layout; storage needs it to load L2 objects it has not indexed.
    """

    model_name: str
    cache_salt: str
    kv_ranks: Sequence[int]
    chunk_hashes: Sequence[bytes]
    chunk_bytes: int = 0


class NodeStorage(Protocol):
    """What the gateway needs from its node's storage service."""

    #: True when a cancelled lookup_and_lock / prefetch_status leaves nothing
    #: behind (an in-process node gives back what a cancelled lookup locked and
    #: keeps an undelivered status). The gateway then awaits those calls
    #: directly; otherwise it shields them in a task of their own, because a
    #: remote node finishes the call (and takes the locks) whatever the caller
    #: does. Awaiting directly keeps an all-L1 lookup free of event-loop turns.
    cancel_safe: bool

    async def register_engine(self, engine_id: str, registration: object) -> tuple[bool, str]:
        """Map an engine's KV memory; (registered already, the node's instance id)."""
        ...

    async def unregister_engine(self, engine_id: str) -> bool:
        """Unmap an engine's KV memory; True when it existed."""
        ...

    async def lookup_and_lock(
        self, request_id: str, grid: KeyGridSpec, readers: int, wait_ms: int, owner: str
    ) -> PrefetchState:
        """Read-lock the cached prefix of the grid (loading L2 hits into L1).

        The prefetch id is the id of the lease storage holds the locks under,
        owned by ``owner`` (the engine instance; "" = none).
        """
        ...

    async def prefetch_status(self, prefetch_id: str, wait_ms: int) -> PrefetchState:
        """Status of a running prefetch (completed results are delivered once)."""
        ...

    async def end_lease(self, lease_id: str) -> int:
        """End a lookup's lease (or abandon its running prefetch); locks released."""
        ...

    async def release_lease(self, lease_id: str, first_chunk: int, last_chunk: int) -> int:
        """Release the lease's locks on chunks [first, last) of its prefix; how many."""
        ...

    async def end_owner_leases(self, owner: str) -> int:
        """End every lease of ``owner`` (a reaped engine instance); how many."""
        ...

    async def store_chunks(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        chunk_tokens: int,
        producer_event: bytes = b"",
    ) -> list[StoreOutcome]:
        """Copy chunks from the engine's blocks into L1 (after ``producer_event``, CUDA only)."""
        ...

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
        """Copy the cached prefix of the row into the engine's blocks; chunks copied.

        Storage uses (and releases, exactly once) the lookup locks ``lease_id``
        holds on these chunks, whatever the copy's outcome. ``layers``: only
        layers ``[start, end)`` are written, and only a range ending at the last
        layer uses the lease's locks (one part of a load by layers).
        """
        ...

    async def touch(self, grid: KeyGridSpec) -> None:
        """Refresh LRU recency of the grid's keys."""
        ...

    async def clear(self, force: bool) -> int:
        """Drop L1 objects; how many."""
        ...

    async def prepare_store(
        self, row: KeyRow, chunk_bytes: int, segment_tokens: Sequence[int] | np.ndarray = ()
    ) -> PreparedSlots:
        """Reserve L1 slots for the row's uncached chunks. ``segment_tokens``: the row
        is one CacheBlend segment of these tokens, which the node indexes."""
        ...

    async def store_segment(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        start_token: int,
        tokens: Sequence[int] | np.ndarray,
    ) -> StoreOutcome:
        """Gather a request's tokens ``[start_token, +len(tokens))`` into the one segment
        object of ``row`` (keys moved to 0..), indexed by ``tokens``."""
        ...

    async def retrieve_segment(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        start_token: int,
        num_tokens: int,
    ) -> bool:
        """Scatter the resident segment of ``row`` into a request at ``start_token`` (keys
        moved there); False (nothing written) when it is not in L1."""
        ...

    async def find_segments(
        self, row: KeyRow, prompt: Sequence[int] | np.ndarray, stride: int
    ) -> tuple[list[tuple[int, int]], int]:
        """Segments of the row's model, salt and rank (its hashes unused) inside
        ``prompt`` that the node holds, or (with a coordinator) another node does:
        ([(start, length)], positions probed)."""
        ...

    async def commit_store(self, transaction_id: str) -> int:
        """Publish a prepared store; chunks committed."""
        ...

    async def prepare_retrieve(self, row: KeyRow, chunk_bytes: int) -> PreparedSlots:
        """Slots of the row's resident prefix, read-locked until committed."""
        ...

    async def commit_retrieve(self, transaction_id: str, lease_id: str) -> int:
        """Release a prepared retrieve's locks, and the lookup locks ``lease_id`` holds
        on its chunks."""
        ...
