"""Chunk transfers between engines and the node's L1.

LMCache-driven: storage copies between the engine's mapped blocks and L1
(``store``, ``retrieve``). Engine-driven: storage hands out L1 slots, the
engine copies, and a commit publishes the stored chunks or releases the read
locks (``prepare_store``/``commit_store``, ``prepare_retrieve``/
``commit_retrieve``). A retrieve of either kind names its lookup's lease, and
storage uses up (and releases, exactly once) the locks it holds on the
retrieved chunks (see ``lookups``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import validate_cache_salt, worker_kv_rank
from kvmesh.common.layer_range import check_layer_range
from kvmesh.common.node_types import StoreOutcome

from .ahead import AheadLoads, load_key
from .engines import EngineRegistry, RegisteredEngine
from .lookups import LookupLocks
from .node_storage import KeyRow, NodeStorage, PreparedSlots
from .sessions import Session, SessionTable
from .types import GatewayStats, PromptRangeSpec, StoreResult

# Committed engine-driven store transactions remembered, so a retried commit is harmless.
_COMMITTED_STORES_KEPT = 4096
# Prepared engine-driven retrieves whose request is remembered until their commit; one
# never committed is forgotten beyond this many (storage's transaction TTL frees its locks).
_PREPARED_RETRIEVES_KEPT = 65536


@dataclass(frozen=True, slots=True)
class _RetrievePlan:
    """A checked retrieve: what storage copies, and whether it ends the load."""

    engine_id: str
    row: KeyRow
    chunks: int
    block_ids: Sequence[int]
    skip_first_n_tokens: int
    lease_id: str
    layers: tuple[int, int] | None
    final: bool


class Transfers:
    """Store, retrieve and the engine-driven prepare/commit pairs."""

    def __init__(
        self,
        storage: NodeStorage,
        engines: EngineRegistry,
        sessions: SessionTable,
        lookups: LookupLocks,
        counters: GatewayStats,
        *,
        chunk_size: int,
    ) -> None:
        self.storage = storage
        self.engines = engines
        self.sessions = sessions
        self.lookups = lookups
        self.counters = counters
        self.chunk_size = chunk_size
        # Engine-driven retrieve transaction id -> request id.
        self._txn_sessions: OrderedDict[str, str] = OrderedDict()
        self._committed_stores: OrderedDict[str, None] = OrderedDict()
        self.ahead = AheadLoads()

    # ------------------------------------------------------------------ helpers

    def _session(self, rng: PromptRangeSpec) -> Session:
        """The range's request session (a throwaway one, never kept, when it names no
        request: kept, each such call's tokens stayed until the session expired)."""
        if not rng.request_id:
            return self.sessions.throwaway()
        return self.sessions.open(rng.request_id)

    def _row(
        self, engine: RegisteredEngine, rng: PromptRangeSpec, session: Session
    ) -> tuple[KeyRow, int, int]:
        """The engine's keys of the range's chunks, and the chunks [first, last)."""
        spec = engine.spec
        if rng.model_name != spec.model_name or rng.world_size != spec.world_size:
            raise InvalidArgument(
                f"engine {spec.engine_id!r} serves {spec.model_name!r} with world size "
                f"{spec.world_size}, not {rng.model_name!r}/{rng.world_size}",
                field="range.model_name",
            )
        validate_cache_salt(rng.cache_salt, field="range.cache_salt")
        self.sessions.take_tokens(session, rng.token_ids)
        first, last = self.sessions.chunk_range(rng.start_token, rng.end_token, session.tokens.size)
        hashes = self.sessions.hashes(session, last)[first:last]
        row = KeyRow(
            spec.model_name, rng.cache_salt, worker_kv_rank(spec.world_size, spec.worker_id), hashes
        )
        return row, first, last

    @staticmethod
    def _lease_of(session: Session, rng: PromptRangeSpec | None = None) -> str:
        """The lease of the session's lookup, if it is for the same model, world and salt."""
        lookup = session.lookup
        if lookup is None:
            return ""
        if rng is not None and not lookup.matches(rng.model_name, rng.world_size, rng.cache_salt):
            return ""
        return lookup.lease_id

    def _check_block_ids(
        self, engine: RegisteredEngine, block_ids: Sequence[int], n_chunks: int
    ) -> None:
        needed = n_chunks * (self.chunk_size // engine.spec.block_size)
        if len(block_ids) < needed:
            raise InvalidArgument(
                f"{n_chunks} chunks need {needed} block ids, got {len(block_ids)}",
                field="block_ids",
            )

    # ----------------------------------------------------------- LMCache-driven

    async def store(
        self,
        engine_id: str,
        rng: PromptRangeSpec,
        block_ids: Sequence[int],
        producer_event: bytes = b"",
    ) -> StoreResult:
        """Copy the range's chunks from the engine's blocks into the cache."""
        engine = self.engines.get(engine_id, engine_driven=False)
        session = self._session(rng)
        async with session.lock:
            row, first, last = self._row(engine, rng, session)
        self._check_block_ids(engine, block_ids, last - first)
        self.counters.stores += 1
        if last == first:
            return StoreResult(0, 0, 0)
        outcomes = await self.storage.store_chunks(
            engine_id, row, block_ids, self.chunk_size, producer_event
        )
        stored = sum(1 for o in outcomes if o is StoreOutcome.STORED)
        cached = sum(1 for o in outcomes if o is StoreOutcome.ALREADY_CACHED)
        skipped = len(outcomes) - stored - cached
        self.counters.stored_chunks += stored
        self.counters.store_skipped_chunks += skipped
        return StoreResult(stored, cached, skipped)

    async def retrieve(
        self,
        engine_id: str,
        rng: PromptRangeSpec,
        block_ids: Sequence[int],
        skip_first_n_tokens: int,
        producer_event: bytes = b"",
        layers: tuple[int, int] | None = None,
    ) -> int:
        """Copy the range's cached prefix into the engine's blocks; chunks retrieved.

        With ``layers`` only layers ``[start, end)`` are written (one part of a load
        by layers, docs/vllm.md, "Loads by layer"); the counters count the part
        that ends at the last layer, once per load. A whole load that the
        scheduler started ahead (:meth:`retrieve_ahead`) is joined, not repeated.
        """
        plan = await self._plan_retrieve(engine_id, rng, block_ids, skip_first_n_tokens, layers)
        started = self.ahead.claim(self._load_key(plan, rng))
        if started is not None:
            self.counters.retrieves_joined += 1
            got = await asyncio.shield(started)
            if layers is None:
                return got
            # A load by layers never goes with an ahead load, but if one came, its
            # first part waits for it: no copy may follow the worker's own.
        return await self._run_retrieve(plan, producer_event)

    async def retrieve_ahead(
        self,
        engine_id: str,
        rng: PromptRangeSpec,
        block_ids: Sequence[int],
        skip_first_n_tokens: int,
    ) -> bool:
        """Start the whole load the worker will ask for; False when nothing was started
        (GPU memory, the worker asked already, or it is running). See :mod:`.ahead`."""
        engine = self.engines.get(engine_id, engine_driven=False)
        if not engine.host_memory:
            return False
        plan = await self._plan_retrieve(engine_id, rng, block_ids, skip_first_n_tokens, None)
        # Checked after the plan's await, with none before the start: the worker's
        # Retrieve tombstones the key as soon as its own plan is done.
        key = self._load_key(plan, rng)
        if not self.ahead.may_start(key):
            self.counters.retrieves_ahead_refused += 1
            return False
        self.ahead.start(key, rng.request_id, asyncio.ensure_future(self._run_retrieve(plan, b"")))
        self.counters.retrieves_ahead += 1
        return True

    async def _plan_retrieve(
        self,
        engine_id: str,
        rng: PromptRangeSpec,
        block_ids: Sequence[int],
        skip_first_n_tokens: int,
        layers: tuple[int, int] | None,
    ) -> _RetrievePlan:
        """Check a retrieve and name what it copies (raises before anything is copied)."""
        engine = self.engines.get(engine_id, engine_driven=False)
        if layers is not None:
            check_layer_range(engine.num_layers, *layers)
        session = self._session(rng)
        async with session.lock:
            row, first, last = self._row(engine, rng, session)
            if skip_first_n_tokens > rng.end_token - rng.start_token:
                raise InvalidArgument(
                    "skip_first_n_tokens is beyond the range", field="skip_first_n_tokens"
                )
            self._check_block_ids(engine, block_ids, last - first)
            lease_id = self._lease_of(session, rng)
        final = layers is None or layers[1] == engine.num_layers
        return _RetrievePlan(
            engine_id, row, last - first, block_ids, skip_first_n_tokens, lease_id, layers, final
        )

    @staticmethod
    def _load_key(plan: _RetrievePlan, rng: PromptRangeSpec) -> bytes:
        return load_key(
            plan.engine_id, rng, plan.block_ids, plan.skip_first_n_tokens, plan.row.chunk_hashes
        )

    async def _run_retrieve(self, plan: _RetrievePlan, producer_event: bytes) -> int:
        if plan.final:
            self.counters.retrieves += 1
        if plan.chunks == 0:
            return 0
        got = await self.storage.retrieve_chunks(
            plan.engine_id, plan.row, plan.block_ids, self.chunk_size, plan.skip_first_n_tokens,
            plan.lease_id, producer_event, plan.layers,
        )  # fmt: skip
        if plan.final:
            self.counters.retrieved_chunks += got
            self.counters.retrieve_missed_chunks += plan.chunks - got
        return got

    # ------------------------------------------------------------ engine-driven

    async def prepare_store(self, engine_id: str, rng: PromptRangeSpec) -> PreparedSlots:
        """Reserve slots for the range's uncached chunks."""
        engine = self.engines.get(engine_id, engine_driven=True)
        session = self._session(rng)
        async with session.lock:
            row, first, last = self._row(engine, rng, session)
        if last == first:
            return PreparedSlots("", [])
        return await self.storage.prepare_store(row, engine.chunk_bytes)

    async def commit_store(self, engine_id: str, transaction_id: str) -> int:
        """Publish a prepared store; a repeated commit (a retry) publishes nothing, harmlessly."""
        self.engines.get(engine_id, engine_driven=True)
        if transaction_id in self._committed_stores:
            return 0
        committed = await self.storage.commit_store(transaction_id)
        # Storage forgets a committed transaction (a second commit there is NOT_FOUND);
        # the contract promises engines that committing twice is harmless.
        self._committed_stores[transaction_id] = None
        while len(self._committed_stores) > _COMMITTED_STORES_KEPT:
            self._committed_stores.popitem(last=False)
        self.counters.stored_chunks += committed
        return committed

    async def prepare_retrieve(self, engine_id: str, rng: PromptRangeSpec) -> PreparedSlots:
        """Slots of the range's cached prefix, for the engine to copy from."""
        engine = self.engines.get(engine_id, engine_driven=True)
        session = self._session(rng)
        async with session.lock:
            row, first, last = self._row(engine, rng, session)
            if last == first:
                return PreparedSlots("", [])
            prepared = await self.storage.prepare_retrieve(row, engine.chunk_bytes)
            if prepared.transaction_id:
                session.retrieves[prepared.transaction_id] = (
                    engine.spec.worker_id,
                    first,
                    last,
                )
                self._txn_sessions[prepared.transaction_id] = rng.request_id
                while len(self._txn_sessions) > _PREPARED_RETRIEVES_KEPT:
                    self._txn_sessions.popitem(last=False)
        return prepared

    async def commit_retrieve(self, engine_id: str, transaction_id: str) -> int:
        """Release a prepared retrieve's locks and the lookup locks it used."""
        self.engines.get(engine_id, engine_driven=True)
        request_id = self._txn_sessions.pop(transaction_id, None)
        session = self.sessions.get(request_id) if request_id else None
        lease_id = ""
        if session is not None:
            async with session.lock:
                if session.retrieves.pop(transaction_id, None) is not None:
                    lease_id = self._lease_of(session)
        released = await self.storage.commit_retrieve(transaction_id, lease_id)
        self.counters.retrieved_chunks += released
        return released
