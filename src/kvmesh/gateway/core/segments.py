"""CacheBlend segments of engine-driven contexts: objects keyed by their tokens alone.

A segment (a document) is one L1 object of any length, under the key
:func:`kvmesh.common.hashing.segment_key` of the context's model and the
segment's tokens, with the request's salt: nothing of the prompt before it, so
a later prompt finds it wherever it sits (docs/blend.md, "Segments in
storage"). Its size follows from the context's geometry: per token, the
chunk object's bytes divided by the chunk size. The commits are the
engine-driven path's own (``Transfers.commit_store`` and ``commit_retrieve``).

To find segments in a prompt whose boundaries the engine does not know
(``lookup``), each store hands the node the segment's tokens: the node keeps
the fingerprint index beside the objects (``FindSegments``), so a gateway
restart loses nothing and every gateway of a node sees every segment.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.hashing import segment_key
from kvmesh.common.keys import validate_cache_salt, worker_kv_rank
from kvmesh.common.node_types import StoreOutcome

from .engines import EngineRegistry, RegisteredEngine
from .node_storage import KeyGridSpec, KeyRow, NodeStorage, PreparedSlots
from .sessions import check_token_count
from .types import GatewayStats

#: Longest wait for a segment to come in from L2 or a peer before it counts as a miss.
SEGMENT_FETCH_WAIT_MS = 5_000


@dataclass(frozen=True, slots=True)
class SegmentSlot:
    """A segment's slot: the storage transaction and where the object lives."""

    transaction_id: str  # empty: no slot (cached already, or not resident)
    path: str
    offset_bytes: int
    size_bytes: int
    segment_bytes: int
    already_cached: bool = False


class Segments:
    """Prepare-store and prepare-retrieve of segments."""

    def __init__(
        self,
        storage: NodeStorage,
        engines: EngineRegistry,
        counters: GatewayStats,
        *,
        chunk_size: int,
        max_tokens: int,
    ) -> None:
        self.storage = storage
        self.engines = engines
        self.counters = counters
        self.chunk_size = chunk_size
        self.max_tokens = max_tokens

    def _row(
        self,
        engine_id: str,
        cache_salt: str,
        tokens: Sequence[int] | np.ndarray,
        *,
        engine_driven: bool = True,
        field: str = "token_ids",
    ) -> tuple[RegisteredEngine, KeyRow, int]:
        """The engine (an engine-driven context, or one that registered its KV cache),
        the segment's one-key row and the segment's object size."""
        engine = self.engines.get(engine_id, engine_driven=engine_driven)
        validate_cache_salt(cache_salt)
        count = len(tokens)
        if count == 0:
            raise InvalidArgument("a segment needs at least one token", field=field)
        check_token_count(count, self.max_tokens)
        # An MLA context has one plane (a registered engine's layout is checked by storage).
        if engine.chunk_shape and engine.chunk_shape[0] != 2:
            raise InvalidArgument(
                "segments need a K/V context (an MLA context has one plane)", field="engine_id"
            )
        spec = engine.spec
        key = segment_key(spec.model_name, np.asarray(tokens, dtype=np.uint32))
        row = KeyRow(
            spec.model_name, cache_salt, worker_kv_rank(spec.world_size, spec.worker_id), [key]
        )
        return engine, row, engine.chunk_bytes // self.chunk_size * count

    @staticmethod
    def _slot(prepared: PreparedSlots, nbytes: int) -> SegmentSlot:
        if not prepared.slots:
            cached = prepared.already_cached_chunks > 0
            return SegmentSlot(prepared.transaction_id, "", 0, 0, nbytes, already_cached=cached)
        slot = prepared.slots[0]
        return SegmentSlot(
            prepared.transaction_id, slot.path, slot.offset_bytes, slot.size_bytes, nbytes
        )

    async def prepare_store(
        self, engine_id: str, cache_salt: str, tokens: Sequence[int] | np.ndarray
    ) -> SegmentSlot:
        """A slot for the segment's object, or none when it is cached already; the node
        indexes the segment by its tokens either way."""
        _, row, nbytes = self._row(engine_id, cache_salt, tokens)
        prepared = await self.storage.prepare_store(row, nbytes, segment_tokens=tokens)
        slot = self._slot(prepared, nbytes)
        if slot.transaction_id:
            self.counters.segment_stores += 1
        return slot

    async def prepare_retrieve(
        self, engine_id: str, cache_salt: str, tokens: Sequence[int] | np.ndarray
    ) -> SegmentSlot:
        """The segment's slot, read-locked until the commit; none when the node cannot
        have it in L1 (after loading it from L2 or fetching it from a peer)."""
        _, row, nbytes = self._row(engine_id, cache_salt, tokens)
        slot = self._slot(await self.storage.prepare_retrieve(row, nbytes), nbytes)
        if not slot.transaction_id:
            async with self._fetched(row, nbytes) as arrived:
                if arrived:  # read-locked by the retrieve before the lease ends
                    slot = self._slot(await self.storage.prepare_retrieve(row, nbytes), nbytes)
        if slot.transaction_id:
            self.counters.segment_hits += 1
        else:
            self.counters.segment_misses += 1
        return slot

    @contextlib.asynccontextmanager
    async def _fetched(self, row: KeyRow, nbytes: int) -> AsyncIterator[bool]:
        """Bring a segment missing from L1 in from L2 or a peer (the node's lookup path,
        one key) and hold it there under the lookup's lease while the block runs;
        yields whether it arrived. An object loaded from L2 is temporary (freed with
        its last reader), so the lease ends only after the caller took its own lock."""
        grid = KeyGridSpec(row.model_name, row.cache_salt, [row.kv_rank], row.chunk_hashes, nbytes)
        state = await self.storage.lookup_and_lock(
            "segment", grid, 1, SEGMENT_FETCH_WAIT_MS, owner=""
        )
        try:
            yield state.completed and state.hit_chunks > 0
        finally:
            await self.storage.end_lease(state.prefetch_id)

    async def store_placed(
        self,
        engine_id: str,
        cache_salt: str,
        tokens: Sequence[int] | np.ndarray,
        block_ids: Sequence[int],
        start_token: int,
    ) -> StoreOutcome:
        """Gather a document out of a registered engine's request into its segment."""
        _, row, _ = self._row(
            engine_id, cache_salt, tokens, engine_driven=False, field="segment.token_ids"
        )
        outcome = await self.storage.store_segment(engine_id, row, block_ids, start_token, tokens)
        if outcome is StoreOutcome.STORED:
            self.counters.segment_stores += 1
        return outcome

    async def retrieve_placed(
        self,
        engine_id: str,
        cache_salt: str,
        tokens: Sequence[int] | np.ndarray,
        block_ids: Sequence[int],
        start_token: int,
    ) -> bool:
        """Write a document's segment into a registered engine's request (loading it from
        L2 or a peer first when it is not in L1); whether it was found."""
        _, row, nbytes = self._row(
            engine_id, cache_salt, tokens, engine_driven=False, field="segment.token_ids"
        )
        count = len(tokens)
        found = await self.storage.retrieve_segment(engine_id, row, block_ids, start_token, count)
        if not found:
            async with self._fetched(row, nbytes) as arrived:
                if arrived:
                    found = await self.storage.retrieve_segment(
                        engine_id, row, block_ids, start_token, count
                    )
        if found:
            self.counters.segment_hits += 1
        else:
            self.counters.segment_misses += 1
        return found

    async def lookup(
        self, engine_id: str, cache_salt: str, tokens: Sequence[int] | np.ndarray, stride: int
    ) -> tuple[list[tuple[int, int]], int]:
        """Stored segments in the prompt ``tokens``: ([(start, length)], positions probed)."""
        engine = self.engines.get(engine_id, engine_driven=None)
        validate_cache_salt(cache_salt)
        check_token_count(len(tokens), self.max_tokens)
        spec = engine.spec
        like = KeyRow(
            spec.model_name, cache_salt, worker_kv_rank(spec.world_size, spec.worker_id), []
        )
        matches, probed = await self.storage.find_segments(like, tokens, stride)
        self.counters.segment_hits += len(matches)
        return matches, probed
