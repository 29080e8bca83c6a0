"""The Gateway facade: engines, sessions, lookups and transfers, composed.

The servicer (and the unit tests) call this one class; each method hands the
call to the piece that owns it:

- ``engines``: the engine registry (registration, liveness, reaping);
- ``sessions``: request sessions (tokens, chunk hashes, idleness);
- ``lookups``: lookups, prefetch status and every release of their read locks;
- ``transfers``: store/retrieve and the engine-driven prepare/commit pairs.

Plain asyncio Python with no protobuf types: the servicer converts at the
edge (``kvmesh.gateway.wire``), and the node's storage service is reached
through the :class:`NodeStorage` protocol (``kvmesh.gateway.link``
implements it over gRPC, ``kvmesh.node.local_link`` in-process; unit tests
use an in-memory fake).

Differences from LMCache 0.5.6, on purpose:
- sessions expire after ``session_ttl`` of *idleness* (LMCache: from creation);
- a finished lookup result can be queried any number of times until the
  session ends (LMCache consumes it once, so a retried query sees 0);
- unknown request ids are NOT_FOUND rather than a silent 0, and every
  expected failure is a status code, never a missing reply;
- a chunk size that the engine's block size does not divide is rejected at
  registration, instead of silently giving 0 % hits;
- storage owns a lookup's read locks, as a lease the gateway only names:
  each lock is released exactly once, and a Lookup whose engine goes away
  mid-call still ends its lease (see ``lookups``);
- an engine or engine instance silent for ``engine_reap_s`` is reaped: its
  KV memory unmapped, its sessions and leases ended (see ``engines``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvmesh.common.hashing import TokenHasher
from kvmesh.common.node_types import StoreOutcome

from .engines import EngineRegistry
from .lookups import LookupLocks
from .node_storage import NodeStorage, PreparedSlots
from .segments import Segments, SegmentSlot
from .sessions import SessionTable
from .transfers import Transfers
from .types import EngineSpec, GatewayStats, PrefetchStatus, PromptRangeSpec, StoreResult


class Gateway:
    """Engine-facing semantics over one node's storage service."""

    def __init__(
        self,
        storage: NodeStorage,
        *,
        chunk_size: int = 256,
        session_ttl_s: float = 600.0,
        max_tokens: int = 1_000_000,
        max_wait_ms: int = 60_000,
        engine_reap_s: float = 120.0,
        hash_memo_entries: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage = storage
        self.chunk_size = chunk_size
        self.hasher = TokenHasher(chunk_size, memo_entries=hash_memo_entries)
        self._clock = clock
        self.counters = GatewayStats()
        self.engines = EngineRegistry(
            storage, self.counters, chunk_size=chunk_size, reap_after_s=engine_reap_s, clock=clock
        )
        self.sessions = SessionTable(
            self.hasher,
            chunk_size=chunk_size,
            max_tokens=max_tokens,
            ttl_s=session_ttl_s,
            clock=clock,
        )
        self.lookups = LookupLocks(
            storage,
            self.sessions,
            self.engines,
            self.counters,
            chunk_size=chunk_size,
            max_wait_ms=max_wait_ms,
        )
        self.engines.on_owner_gone = self.end_owner
        self.transfers = Transfers(
            storage,
            self.engines,
            self.sessions,
            self.lookups,
            self.counters,
            chunk_size=chunk_size,
        )
        self.segments = Segments(
            storage, self.engines, self.counters, chunk_size=chunk_size, max_tokens=max_tokens
        )

    @property
    def storage_instance_id(self) -> str:
        """The node instance id storage reported at the last registration."""
        return self.engines.storage_instance_id

    # ------------------------------------------------------------------ engines

    async def register_kv_cache(
        self,
        spec: EngineSpec,
        registration: object,
        fingerprint: object,
        chunk_bytes: int = 0,
        num_layers: int = 0,
        host_memory: bool = False,
        kv_format: tuple[int, ...] = (),
    ) -> bool:
        """Register an engine's KV memory (LMCache-driven path); True if already registered."""
        return await self.engines.register_kv_cache(
            spec, registration, fingerprint, chunk_bytes, num_layers, host_memory, kv_format
        )

    async def unregister_kv_cache(self, engine_id: str) -> bool:
        """Forget an engine and unmap its memory. Idempotent."""
        return await self.engines.unregister_kv_cache(engine_id)

    def register_engine_context(
        self, spec: EngineSpec, num_layers: int, kv_heads: int, head_dim: int,
        itemsize: int, use_mla: bool, kv_format: tuple[int, ...] = (),
    ) -> tuple[tuple[int, ...], bool]:  # fmt: skip
        """Register an engine-driven context; returns (chunk shape, already registered)."""
        return self.engines.register_engine_context(
            spec, num_layers, kv_heads, head_dim, itemsize, use_mla, kv_format
        )

    def unregister_engine_context(self, engine_id: str) -> bool:
        """Forget an engine-driven context. Idempotent."""
        return self.engines.unregister_engine_context(engine_id)

    def ping(self, engine_id: str) -> bool:
        """Refresh an engine's liveness; False when it is unknown."""
        return self.engines.ping(engine_id)

    def report_block_allocation(self, engine_id: str, request_ids: Sequence[str]) -> None:
        """Count the scheduler's allocations (observability only)."""
        self.engines.report_block_allocation(engine_id, request_ids)

    def engine_ids(self) -> list[str]:
        """Registered engines."""
        return self.engines.ids()

    # ------------------------------------------------------------------ lookups

    async def lookup(
        self,
        request_id: str,
        model_name: str,
        world_size: int,
        cache_salt: str,
        token_ids: np.ndarray,
        end_token: int,
        num_kv_readers: int,
        wait_ms: int,
        owner: str = "",
    ) -> tuple[PrefetchStatus, int]:
        """Hash the prompt and lock its cached prefix; returns (status, requested chunks)."""
        return await self.lookups.lookup(
            request_id,
            model_name,
            world_size,
            cache_salt,
            token_ids,
            end_token,
            num_kv_readers,
            wait_ms,
            owner,
        )

    async def query_prefetch_status(self, request_id: str) -> PrefetchStatus:
        """Non-blocking status of a request's lookup."""
        return await self.lookups.query_prefetch_status(request_id)

    async def wait_prefetch_status(self, request_id: str, timeout_ms: int) -> PrefetchStatus:
        """Status of a request's lookup, waiting up to ``timeout_ms`` for completion."""
        return await self.lookups.wait_prefetch_status(request_id, timeout_ms)

    async def free_lookup_locks(self, request_id: str, start_token: int, end_token: int) -> int:
        """Release the lookup locks held on chunks in [start_token, end_token)."""
        return await self.lookups.free_lookup_locks(request_id, start_token, end_token)

    async def end_session(self, request_id: str) -> tuple[bool, int]:
        """End a request: release what it still holds, refresh LRU of its chunks."""
        self.transfers.ahead.forget_request(request_id)
        return await self.lookups.end_session(request_id)

    async def end_owner(self, owner: str) -> int:
        """End the sessions and leases of an engine instance that went silent."""
        return await self.lookups.end_owner(owner)

    # ---------------------------------------------------------------- transfers

    async def store(
        self,
        engine_id: str,
        rng: PromptRangeSpec,
        block_ids: Sequence[int],
        producer_event: bytes = b"",
    ) -> StoreResult:
        """Copy the range's chunks from the engine's blocks into the cache."""
        return await self.transfers.store(engine_id, rng, block_ids, producer_event)

    async def retrieve(
        self,
        engine_id: str,
        rng: PromptRangeSpec,
        block_ids: Sequence[int],
        skip_first_n_tokens: int,
        producer_event: bytes = b"",
        layers: tuple[int, int] | None = None,
    ) -> int:
        """Copy the range's cached prefix (only ``layers`` when given) into the engine's
        blocks; chunks retrieved."""
        return await self.transfers.retrieve(
            engine_id, rng, block_ids, skip_first_n_tokens, producer_event, layers
        )

    async def retrieve_ahead(
        self,
        engine_id: str,
        rng: PromptRangeSpec,
        block_ids: Sequence[int],
        skip_first_n_tokens: int,
    ) -> bool:
        """Start the whole load the engine's worker will ask for (see ``transfers``)."""
        return await self.transfers.retrieve_ahead(engine_id, rng, block_ids, skip_first_n_tokens)

    async def prepare_store(self, engine_id: str, rng: PromptRangeSpec) -> PreparedSlots:
        """Reserve slots for the range's uncached chunks."""
        return await self.transfers.prepare_store(engine_id, rng)

    async def commit_store(self, engine_id: str, transaction_id: str) -> int:
        """Publish a prepared store; a repeated commit (a retry) publishes nothing, harmlessly."""
        return await self.transfers.commit_store(engine_id, transaction_id)

    async def prepare_retrieve(self, engine_id: str, rng: PromptRangeSpec) -> PreparedSlots:
        """Slots of the range's cached prefix, for the engine to copy from."""
        return await self.transfers.prepare_retrieve(engine_id, rng)

    async def commit_retrieve(self, engine_id: str, transaction_id: str) -> int:
        """Release a prepared retrieve's locks and the lookup locks it used."""
        return await self.transfers.commit_retrieve(engine_id, transaction_id)

    async def prepare_segment_store(
        self, engine_id: str, cache_salt: str, tokens: Sequence[int] | np.ndarray
    ) -> SegmentSlot:
        """A slot for a CacheBlend segment's object (none when it is cached already)."""
        return await self.segments.prepare_store(engine_id, cache_salt, tokens)

    async def prepare_segment_retrieve(
        self, engine_id: str, cache_salt: str, tokens: Sequence[int] | np.ndarray
    ) -> SegmentSlot:
        """A resident CacheBlend segment's slot, read-locked until the commit."""
        return await self.segments.prepare_retrieve(engine_id, cache_salt, tokens)

    async def lookup_segments(
        self, engine_id: str, cache_salt: str, tokens: Sequence[int] | np.ndarray, stride: int
    ) -> tuple[list[tuple[int, int]], int]:
        """Stored CacheBlend segments inside a prompt: ([(start, length)], positions probed)."""
        return await self.segments.lookup(engine_id, cache_salt, tokens, stride)

    async def store_segment(
        self,
        engine_id: str,
        cache_salt: str,
        tokens: Sequence[int] | np.ndarray,
        block_ids: Sequence[int],
        start_token: int,
    ) -> StoreOutcome:
        """A document of a registered engine's request into its CacheBlend segment."""
        return await self.segments.store_placed(
            engine_id, cache_salt, tokens, block_ids, start_token
        )

    async def retrieve_segment(
        self,
        engine_id: str,
        cache_salt: str,
        tokens: Sequence[int] | np.ndarray,
        block_ids: Sequence[int],
        start_token: int,
    ) -> bool:
        """A document's CacheBlend segment into a registered engine's request."""
        return await self.segments.retrieve_placed(
            engine_id, cache_salt, tokens, block_ids, start_token
        )

    async def clear(self, force: bool) -> int:
        """Drop this node's L1 objects."""
        return await self.storage.clear(force)

    # -------------------------------------------------------------- maintenance

    async def sweep(self) -> None:
        """Expire idle sessions (releasing their locks) and reap silent engines."""
        now = self._clock()
        await self.lookups.expire_idle(now)
        await self.engines.reap(now)

    async def close(self, timeout: float = 5.0) -> None:
        """Let background lock releases finish (bounded), then cancel what is left."""
        await self.lookups.close(timeout)

    def stats(self) -> dict[str, object]:
        """Counters and gauges for metrics and status."""
        data: dict[str, object] = dict(vars(self.counters))
        data["active_sessions"] = len(self.sessions)
        data["registered_engines"] = len(self.engines)
        data["live_owners"] = self.engines.owners
        data["hash_memo_hits"] = self.hasher.memo_hits
        data["hash_memo_misses"] = self.hasher.memo_misses
        return data
