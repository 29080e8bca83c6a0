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

from kvmesh.common.node_types import PrefetchState, Slot, StoreOutcome


class StorageRejected(Exception):
    """Storage refused a request before it changed anything; ``error`` is its answer.

    A :class:`NodeStorage` raises it from the calls that also release lookup
    locks (``retrieve_chunks``, ``commit_retrieve``) when the refusal means
    those locks were *not* released, so the core can keep counting them as
    held. The core re-raises ``error`` so the engine sees storage's status.
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


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
        self, request_id: str, grid: KeyGridSpec, readers: int, wait_ms: int
    ) -> PrefetchState:
        """Read-lock the cached prefix of the grid (loading L2 hits into L1)."""
        ...

    async def prefetch_status(self, prefetch_id: str, wait_ms: int) -> PrefetchState:
        """Status of a running prefetch (completed results are delivered once)."""
        ...

    async def release_prefetch(self, prefetch_id: str) -> None:
        """Abandon a running prefetch (its locks are released when it finishes)."""
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
        release_mask: Sequence[bool],
        producer_event: bytes = b"",
    ) -> int:
        """Copy the cached prefix of the row into the engine's blocks; chunks copied.

        Releases one lookup lock per chunk flagged in ``release_mask``, also when
        the copy fails, unless it raises :class:`StorageRejected`.
        """
        ...

    async def release_locks(self, grid: KeyGridSpec, count: int) -> int:
        """Release ``count`` read locks on every key of the grid; keys released."""
        ...

    async def touch(self, grid: KeyGridSpec) -> None:
        """Refresh LRU recency of the grid's keys."""
        ...

    async def clear(self, force: bool) -> int:
        """Drop L1 objects; how many."""
        ...

    async def prepare_store(self, row: KeyRow, chunk_bytes: int) -> PreparedSlots:
        """Reserve L1 slots for the row's uncached chunks."""
        ...

    async def commit_store(self, transaction_id: str) -> int:
        """Publish a prepared store; chunks committed."""
        ...

    async def prepare_retrieve(self, row: KeyRow, chunk_bytes: int) -> PreparedSlots:
        """Slots of the row's resident prefix, read-locked until committed."""
        ...

    async def commit_retrieve(self, transaction_id: str, release_mask: Sequence[bool]) -> int:
        """Release a prepared retrieve's locks (and flagged lookup locks).

        Raises :class:`StorageRejected` when nothing was released.
        """
        ...
