"""CacheBlend segments of engine-driven contexts: objects keyed by their tokens alone.

A segment (a document) is one L1 object of any length, under the key
:func:`kvmesh.common.hashing.segment_key` of the context's model and the
segment's tokens, with the request's salt: nothing of the prompt before it, so
a later prompt finds it wherever it sits (docs/blend.md, "Segments in
storage"). Its size follows from the context's geometry: per token, the
chunk object's bytes divided by the chunk size. The commits are the
engine-driven path's own (``Transfers.commit_store`` and ``commit_retrieve``).

To find segments in a prompt whose boundaries the engine does not know
(``lookup``), every segment of at least :data:`FINGERPRINT_TOKENS` tokens that
this gateway stored is indexed by its first ones (the raw token bytes are the
dictionary key: nothing is hashed per probe). An index entry is a hint: a hit
is checked against the segment's whole key and the node's L1, and dropped when
the segment is gone. The index lives in the gateway's memory (bounded, least
recently stored dropped first); a restarted gateway finds only what it stores
again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.hashing import segment_key, tokens_to_be_u32
from kvmesh.common.keys import validate_cache_salt, worker_kv_rank

from .engines import EngineRegistry, RegisteredEngine
from .node_storage import KeyRow, NodeStorage, PreparedSlots
from .sessions import check_token_count
from .types import GatewayStats

#: Tokens at a segment's start that index it; shorter segments are not found by lookup.
FINGERPRINT_TOKENS = 16
#: Index entries kept (one per distinct segment start).
INDEX_ENTRIES = 65_536


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
        # (model, salt, first tokens' bytes) -> the lengths of segments starting so.
        self._index: OrderedDict[tuple[str, str, bytes], set[int]] = OrderedDict()

    def _row(
        self, engine_id: str, cache_salt: str, tokens: Sequence[int] | np.ndarray
    ) -> tuple[RegisteredEngine, KeyRow, int]:
        """The engine, the segment's one-key row and the segment's object size."""
        engine = self.engines.get(engine_id, engine_driven=True)
        validate_cache_salt(cache_salt)
        count = len(tokens)
        if count == 0:
            raise InvalidArgument("a segment needs at least one token", field="token_ids")
        check_token_count(count, self.max_tokens)
        if engine.chunk_shape[0] != 2:
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
        """A slot for the segment's object, or none when it is cached already."""
        engine, row, nbytes = self._row(engine_id, cache_salt, tokens)
        slot = self._slot(await self.storage.prepare_store(row, nbytes), nbytes)
        if slot.transaction_id:
            self.counters.segment_stores += 1
        if len(tokens) >= FINGERPRINT_TOKENS and (slot.transaction_id or slot.already_cached):
            head = tokens_to_be_u32(np.asarray(tokens[:FINGERPRINT_TOKENS], dtype=np.uint32))
            entry = (engine.spec.model_name, cache_salt, head)
            self._index.setdefault(entry, set()).add(len(tokens))
            self._index.move_to_end(entry)
            while len(self._index) > INDEX_ENTRIES:
                self._index.popitem(last=False)
        return slot

    async def prepare_retrieve(
        self, engine_id: str, cache_salt: str, tokens: Sequence[int] | np.ndarray
    ) -> SegmentSlot:
        """The segment's slot, read-locked until the commit; none when not resident."""
        _, row, nbytes = self._row(engine_id, cache_salt, tokens)
        slot = self._slot(await self.storage.prepare_retrieve(row, nbytes), nbytes)
        if slot.transaction_id:
            self.counters.segment_hits += 1
        else:
            self.counters.segment_misses += 1
        return slot

    async def _resident(self, engine_id: str, cache_salt: str, tokens: np.ndarray) -> bool:
        """Whether the segment of ``tokens`` is in L1 (locked and released at once)."""
        _, row, nbytes = self._row(engine_id, cache_salt, tokens)
        prepared = await self.storage.prepare_retrieve(row, nbytes)
        if not prepared.transaction_id:
            return False
        await self.storage.commit_retrieve(prepared.transaction_id, "")
        return True

    async def lookup(
        self, engine_id: str, cache_salt: str, tokens: Sequence[int] | np.ndarray, stride: int
    ) -> tuple[list[tuple[int, int]], int]:
        """Stored segments in the prompt ``tokens``: ([(start, length)], positions probed)."""
        engine = self.engines.get(engine_id, engine_driven=True)
        validate_cache_salt(cache_salt)
        check_token_count(len(tokens), self.max_tokens)
        step = max(1, stride)
        prompt = np.asarray(tokens, dtype=np.uint32)
        raw = tokens_to_be_u32(prompt)
        model = engine.spec.model_name
        width = 4 * FINGERPRINT_TOKENS
        matches: list[tuple[int, int]] = []
        probed = 0
        at = 0
        while at + FINGERPRINT_TOKENS <= prompt.size:
            probed += 1
            entry = (model, cache_salt, raw[4 * at : 4 * at + width])
            lengths = self._index.get(entry, set())
            found = 0
            for length in sorted(lengths, reverse=True):
                if at + length > prompt.size:
                    continue
                if await self._resident(engine_id, cache_salt, prompt[at : at + length]):
                    found = length
                    break
                lengths.discard(length)  # the segment left L1: forget it
            if entry in self._index and not lengths:
                del self._index[entry]
            if found:
                matches.append((at, found))
                self.counters.segment_hits += 1
                at += found
                at += -at % step  # the next probe position
            else:
                at += step
        return matches, probed
