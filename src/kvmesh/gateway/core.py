"""The gateway's core: engines, sessions, token hashing and LMCache's request semantics.

Plain asyncio Python with no protobuf types: the servicer converts at the
edge, and the node's storage service is reached through the
:class:`NodeStorage` protocol (``src/kvmesh/gateway/link.py`` implements it
over gRPC; unit tests use an in-memory fake).

Lock accounting. A lookup read-locks every key of its hit prefix
``num_kv_readers`` times (one row per kv rank). The session records how many
of those locks are still held per (rank, chunk); Retrieve releases one per
retrieved chunk of its rank, FreeLookupLocks releases what is left in a
range, and EndSession or session expiry release everything that remains. So
a lock is released exactly once, and an aborted request never pins memory
until the storage-side TTL (LMCache leaks them until then).

Differences from LMCache 0.5.6, on purpose:
- sessions expire after ``session_ttl`` of *idleness* (LMCache: from creation);
- a finished lookup result can be queried any number of times until the
  session ends (LMCache consumes it once, so a retried query sees 0);
- unknown request ids are NOT_FOUND rather than a silent 0, and every
  expected failure is a status code, never a missing reply;
- a chunk size that the engine's block size does not divide is rejected at
  registration, instead of silently giving 0 % hits;
- a Lookup whose engine goes away mid-call (closed channel, passed deadline)
  still gives back the locks storage took for it, and locks whose release
  storage refused or never received stay counted until a retry, EndSession
  or expiry releases them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvmesh.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvmesh.common.hashing import NONE_HASH, TokenHasher
from kvmesh.common.keys import validate_cache_salt, validate_model_name, worker_kv_rank
from kvmesh.common.node_types import PrefetchState, Slot, StoreOutcome

logger = logging.getLogger(__name__)

MAX_KV_READERS = 128
# Committed engine-driven store transactions remembered, so a retried commit is harmless.
_COMMITTED_STORES_KEPT = 4096


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
        self, engine_id: str, row: KeyRow, block_ids: Sequence[int], chunk_tokens: int
    ) -> list[StoreOutcome]:
        """Copy chunks from the engine's blocks into L1."""
        ...

    async def retrieve_chunks(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        chunk_tokens: int,
        skip_first_n_tokens: int,
        release_mask: Sequence[bool],
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


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """An engine worker as it registers."""

    engine_id: str
    model_name: str
    world_size: int
    worker_id: int
    block_size: int


@dataclass(slots=True)
class _Engine:
    spec: EngineSpec
    engine_driven: bool
    chunk_bytes: int
    chunk_shape: tuple[int, ...]
    registered_at: float
    last_seen: float
    pinged: bool = False
    fingerprint: object = None


@dataclass(frozen=True, slots=True)
class PromptRangeSpec:
    """The token range of a request that an engine call is about."""

    request_id: str
    model_name: str
    world_size: int
    cache_salt: str
    token_ids: np.ndarray
    start_token: int
    end_token: int


@dataclass(frozen=True, slots=True)
class PrefetchStatus:
    """What Lookup / QueryPrefetchStatus return to the engine."""

    completed: bool
    hit_chunks: int = 0
    hit_tokens: int = 0
    l1_hit_chunks: int = 0
    l2_hit_chunks: int = 0


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Counts of a store."""

    stored_chunks: int
    already_cached_chunks: int
    skipped_chunks: int


@dataclass(slots=True)
class _Lookup:
    model_name: str
    world_size: int
    cache_salt: str
    readers: int
    requested_chunks: int
    chunk_hashes: list[bytes]
    prefetch_id: str
    completed: bool = False
    hit_chunks: int = 0
    l1_hit_chunks: int = 0
    l2_hit_chunks: int = 0
    # remaining[rank][chunk]: lookup read locks still held (set when completed).
    remaining: list[list[int]] = field(default_factory=list)

    def kv_ranks(self) -> list[int]:
        return [worker_kv_rank(self.world_size, r) for r in range(self.world_size)]

    def matches(self, model_name: str, world_size: int, cache_salt: str) -> bool:
        return (self.model_name, self.world_size, self.cache_salt) == (
            model_name,
            world_size,
            cache_salt,
        )


@dataclass(slots=True)
class _Session:
    request_id: str
    last_used: float
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint32))
    hashes: list[bytes] = field(default_factory=list)
    lookup: _Lookup | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Engine-driven retrieves in flight: transaction id -> (worker id, first chunk, chunks).
    retrieves: dict[str, tuple[int, int, int]] = field(default_factory=dict)


@dataclass
class GatewayStats:
    """Counters exported as ``kvmesh_gateway_*`` metrics."""

    lookups: int = 0
    lookup_requested_tokens: int = 0
    lookup_hit_tokens: int = 0
    lookup_l1_hit_chunks: int = 0
    lookup_l2_hit_chunks: int = 0
    lookups_without_engine: int = 0
    stores: int = 0
    stored_chunks: int = 0
    store_skipped_chunks: int = 0
    retrieves: int = 0
    retrieved_chunks: int = 0
    retrieve_missed_chunks: int = 0
    sessions_expired: int = 0
    prefetch_waits: int = 0
    prefetch_wait_seconds: float = 0.0
    locks_released: int = 0
    engines_reaped: int = 0
    block_allocations: int = 0


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
        self.session_ttl_s = session_ttl_s
        self.max_tokens = max_tokens
        self.max_wait_ms = max_wait_ms
        self.engine_reap_s = engine_reap_s
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        self._sessions: dict[str, _Session] = {}
        # Engine-driven retrieve transaction id -> request id.
        self._txn_sessions: dict[str, str] = {}
        self._committed_stores: OrderedDict[str, None] = OrderedDict()
        # Clean-ups of calls whose engine went away mid-call (kept so they are not collected).
        self._tasks: set[asyncio.Task[None]] = set()
        self.storage_instance_id = ""
        self.counters = GatewayStats()

    # ------------------------------------------------------------------ engines

    def _check_block_size(self, block_size: int) -> None:
        if block_size < 1:
            raise InvalidArgument("block_size must be >= 1", field="layout.block_size")
        if self.chunk_size % block_size != 0:
            raise InvalidArgument(
                f"the gateway's chunk size {self.chunk_size} is not a multiple of the engine's "
                f"block size {block_size}; configure chunk_size as a multiple of it",
                field="layout.block_size",
                reason="CHUNK_SIZE_MISMATCH",
            )

    def _check_engine_spec(self, spec: EngineSpec) -> None:
        if not spec.engine_id:
            raise InvalidArgument("engine_id must not be empty", field="engine_id")
        validate_model_name(spec.model_name)
        if spec.world_size < 1 or spec.world_size > 255:
            raise InvalidArgument("world_size must be in [1, 255]", field="world_size")
        if not 0 <= spec.worker_id < spec.world_size:
            raise InvalidArgument(
                f"worker_id {spec.worker_id} is outside world_size {spec.world_size}",
                field="worker_id",
            )
        self._check_block_size(spec.block_size)

    async def register_kv_cache(
        self,
        spec: EngineSpec,
        registration: object,
        fingerprint: object,
        chunk_bytes: int = 0,
    ) -> bool:
        """Register an engine's KV memory (LMCache-driven path); True if already registered.

        ``storage_instance_id`` is learned from the node's answer.

        ``registration`` is forwarded to storage untouched; ``fingerprint``
        identifies the layout so a re-register with another one is refused.
        """
        self._check_engine_spec(spec)
        existing = self._engines.get(spec.engine_id)
        if existing is not None and (existing.spec != spec or existing.fingerprint != fingerprint):
            raise AlreadyExists(
                f"engine {spec.engine_id!r} is registered with a different layout; "
                "unregister it first",
                reason="ENGINE_LAYOUT_MISMATCH",
                metadata={"engine_id": spec.engine_id},
            )
        already, self.storage_instance_id = await self.storage.register_engine(
            spec.engine_id, registration
        )
        now = self._clock()
        if existing is None:
            self._engines[spec.engine_id] = _Engine(
                spec, False, chunk_bytes, (), now, now, fingerprint=fingerprint
            )
            logger.info(
                "engine %s registered: model %s, worker %d/%d, block size %d",
                spec.engine_id,
                spec.model_name,
                spec.worker_id,
                spec.world_size,
                spec.block_size,
            )
        else:
            existing.last_seen = now
        return already or existing is not None

    async def unregister_kv_cache(self, engine_id: str) -> bool:
        """Forget an engine and unmap its memory. Idempotent."""
        engine = self._engines.pop(engine_id, None)
        existed = await self.storage.unregister_engine(engine_id)
        return engine is not None or existed

    def register_engine_context(
        self, spec: EngineSpec, num_layers: int, kv_heads: int, head_dim: int,
        itemsize: int, use_mla: bool,
    ) -> tuple[tuple[int, ...], bool]:  # fmt: skip
        """Register an engine-driven context; returns (chunk shape, already registered)."""
        self._check_engine_spec(spec)
        for name, value in (
            ("layout.num_layers", num_layers),
            ("layout.kv_heads", kv_heads),
            ("layout.head_dim", head_dim),
        ):
            if value < 1:
                raise InvalidArgument(f"{name} must be >= 1", field=name)
        if use_mla and kv_heads != 1:
            raise InvalidArgument("an MLA layout has kv_heads = 1", field="layout.kv_heads")
        shape = (1 if use_mla else 2, num_layers, self.chunk_size, kv_heads * head_dim)
        chunk_bytes = int(np.prod(shape)) * itemsize
        existing = self._engines.get(spec.engine_id)
        now = self._clock()
        if existing is not None:
            if existing.spec != spec or existing.chunk_shape != shape:
                raise AlreadyExists(
                    f"engine {spec.engine_id!r} is registered with a different geometry",
                    reason="ENGINE_LAYOUT_MISMATCH",
                    metadata={"engine_id": spec.engine_id},
                )
            existing.last_seen = now
            return shape, True
        self._engines[spec.engine_id] = _Engine(spec, True, chunk_bytes, shape, now, now)
        return shape, False

    def unregister_engine_context(self, engine_id: str) -> bool:
        """Forget an engine-driven context. Idempotent."""
        return self._engines.pop(engine_id, None) is not None

    def ping(self, engine_id: str) -> bool:
        """Refresh an engine's liveness; False when it is unknown."""
        if not engine_id:
            return True
        engine = self._engines.get(engine_id)
        if engine is None:
            return False
        engine.last_seen = self._clock()
        engine.pinged = True
        return True

    def _engine(self, engine_id: str, engine_driven: bool) -> _Engine:
        engine = self._engines.get(engine_id)
        if engine is None or engine.engine_driven != engine_driven:
            kind = "an engine-driven context" if engine_driven else "its KV cache"
            raise FailedPrecondition(
                f"engine {engine_id!r} has not registered {kind}",
                reason="ENGINE_NOT_REGISTERED",
                metadata={"engine_id": engine_id},
            )
        engine.last_seen = self._clock()
        return engine

    def _has_engine_for(self, model_name: str, world_size: int) -> bool:
        return any(
            e.spec.model_name == model_name and e.spec.world_size == world_size
            for e in self._engines.values()
        )

    def _chunk_bytes_for(self, model_name: str, world_size: int) -> int:
        """Chunk object size of this model's engines (0 = unknown)."""
        for e in self._engines.values():
            same = e.spec.model_name == model_name and e.spec.world_size == world_size
            if same and e.chunk_bytes:
                return e.chunk_bytes
        return 0

    # ----------------------------------------------------------------- sessions

    def _session(self, request_id: str, create: bool) -> _Session | None:
        session = self._sessions.get(request_id)
        if session is None and create:
            session = _Session(request_id, self._clock())
            self._sessions[request_id] = session
        if session is not None:
            session.last_used = self._clock()
        return session

    def _take_tokens(self, session: _Session, tokens: np.ndarray) -> None:
        """Adopt the request's tokens; keep hashes when the old tokens are a prefix."""
        if tokens.size == 0:
            return
        if tokens.size > self.max_tokens:
            raise InvalidArgument(
                f"{tokens.size} tokens exceed the gateway's limit of {self.max_tokens}",
                field="token_ids",
            )
        old = session.tokens
        if old.size and tokens.size >= old.size and np.array_equal(tokens[: old.size], old):
            session.tokens = tokens
            return
        if old.size and tokens.size < old.size and np.array_equal(old[: tokens.size], tokens):
            return  # a shorter view of the same request (e.g. the prompt only)
        session.tokens = tokens
        session.hashes = []

    def _hashes(self, session: _Session, n_chunks: int) -> list[bytes]:
        """First ``n_chunks`` chunk hashes of the session's tokens (extended incrementally)."""
        have = len(session.hashes)
        if have < n_chunks:
            start = have * self.chunk_size
            prefix = session.hashes[-1] if session.hashes else NONE_HASH
            session.hashes.extend(
                self.hasher.hash_chunks(
                    session.tokens[start : n_chunks * self.chunk_size], prefix_hash=prefix
                )
            )
        return session.hashes[:n_chunks]

    def _check_names(self, model_name: str, world_size: int, cache_salt: str) -> None:
        validate_model_name(model_name)
        validate_cache_salt(cache_salt)
        if not 1 <= world_size <= 255:
            raise InvalidArgument("world_size must be in [1, 255]", field="world_size")

    def _check_wait(self, wait_ms: int, field_name: str) -> int:
        if wait_ms > self.max_wait_ms:
            raise InvalidArgument(
                f"{field_name} {wait_ms} exceeds the gateway's maximum of {self.max_wait_ms} ms",
                field=field_name,
            )
        return wait_ms

    async def _release_lookup(self, lookup: _Lookup) -> int:
        """Release every lock a lookup still holds (or abandon its prefetch)."""
        if not lookup.completed:
            await self.storage.release_prefetch(lookup.prefetch_id)
            lookup.completed = True
            lookup.hit_chunks = 0
            return 0
        return await self._release_remaining(lookup, 0, lookup.hit_chunks)

    async def _release_remaining(self, lookup: _Lookup, first: int, last: int) -> int:
        """Release the locks still held on chunks [first, last) of every rank.

        Callers hold the session lock. A cell is zeroed only after storage took
        its release, so when storage is unreachable the locks stay counted and
        a retried EndSession (or the session's expiry) releases them later.
        """
        ranks = lookup.kv_ranks()
        released = 0
        # Group rows by identical remaining counts so one RPC covers many keys.
        batches: dict[tuple[int, int, int], list[int]] = {}
        for r in range(len(ranks)):
            row = lookup.remaining[r] if r < len(lookup.remaining) else []
            stop = min(last, len(row))
            c = first
            while c < stop:
                count = row[c]
                if count <= 0:
                    c += 1
                    continue
                end = c + 1
                while end < stop and row[end] == count:
                    end += 1
                batches.setdefault((count, c, end), []).append(r)
                c = end
        for (count, lo, hi), rows in batches.items():
            grid = KeyGridSpec(
                lookup.model_name,
                lookup.cache_salt,
                [ranks[r] for r in rows],
                lookup.chunk_hashes[lo:hi],
            )
            await self.storage.release_locks(grid, count)
            for r in rows:
                lookup.remaining[r][lo:hi] = [0] * (hi - lo)
            batch = count * len(rows) * (hi - lo)
            released += batch
            self.counters.locks_released += batch
        return released

    def _complete(self, lookup: _Lookup, state: PrefetchState, *, counted: bool = True) -> None:
        lookup.completed = True
        lookup.hit_chunks = min(state.hit_chunks, lookup.requested_chunks)
        lookup.l1_hit_chunks = state.l1_hit_chunks
        lookup.l2_hit_chunks = state.l2_hit_chunks
        lookup.remaining = [[lookup.readers] * lookup.hit_chunks for _ in range(lookup.world_size)]
        if not counted:
            return
        self.counters.lookup_hit_tokens += lookup.hit_chunks * self.chunk_size
        self.counters.lookup_l1_hit_chunks += lookup.l1_hit_chunks
        self.counters.lookup_l2_hit_chunks += lookup.l2_hit_chunks

    def _status(self, lookup: _Lookup) -> PrefetchStatus:
        if not lookup.completed:
            return PrefetchStatus(False)
        return PrefetchStatus(
            True,
            lookup.hit_chunks,
            lookup.hit_chunks * self.chunk_size,
            lookup.l1_hit_chunks,
            lookup.l2_hit_chunks,
        )

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
    ) -> tuple[PrefetchStatus, int]:
        """Hash the prompt and lock its cached prefix; returns (status, requested chunks)."""
        if not request_id:
            raise InvalidArgument("request_id must not be empty", field="request_id")
        self._check_names(model_name, world_size, cache_salt)
        self._check_wait(wait_ms, "wait_timeout_ms")
        readers = num_kv_readers or 1
        if readers > MAX_KV_READERS:
            raise InvalidArgument(
                f"num_kv_readers must be <= {MAX_KV_READERS}", field="num_kv_readers"
            )
        if end_token > token_ids.size:
            raise InvalidArgument(
                f"end_token {end_token} is beyond the prompt's {token_ids.size} tokens",
                field="end_token",
            )
        end = end_token or token_ids.size
        n_chunks = end // self.chunk_size
        self.counters.lookups += 1
        self.counters.lookup_requested_tokens += n_chunks * self.chunk_size
        session = self._session(request_id, create=True)
        assert session is not None
        async with session.lock:
            self._take_tokens(session, token_ids)
            if session.lookup is not None:
                await self._release_lookup(session.lookup)
                session.lookup = None
            hashes = self._hashes(session, n_chunks)
            if n_chunks == 0 or not self._has_engine_for(model_name, world_size):
                if n_chunks:
                    self.counters.lookups_without_engine += 1
                lookup = _Lookup(model_name, world_size, cache_salt, readers, n_chunks, [], "")
                self._complete(lookup, PrefetchState("", True))
                session.lookup = lookup
                return self._status(lookup), n_chunks
            ranks = [worker_kv_rank(world_size, r) for r in range(world_size)]
            grid = KeyGridSpec(
                model_name, cache_salt, ranks, hashes, self._chunk_bytes_for(model_name, world_size)
            )
            lookup = _Lookup(model_name, world_size, cache_salt, readers, n_chunks, hashes, "")
            if self.storage.cancel_safe:
                state = await self.storage.lookup_and_lock(request_id, grid, readers, wait_ms)
                return self._adopt(session, lookup, state), n_chunks
            call = asyncio.ensure_future(
                self.storage.lookup_and_lock(request_id, grid, readers, wait_ms)
            )
            try:
                # Shielded: if the engine goes away mid-call (channel closed, deadline
                # passed), storage still answers and the locks it took are given back.
                state = await asyncio.shield(call)
            except asyncio.CancelledError:
                self._background(self._release_abandoned(lookup, call))
                raise
            return self._adopt(session, lookup, state), n_chunks

    def _adopt(self, session: _Session, lookup: _Lookup, state: PrefetchState) -> PrefetchStatus:
        """Make a started lookup the session's; its status."""
        lookup.prefetch_id = state.prefetch_id
        if state.completed:
            self._complete(lookup, state)
        session.lookup = lookup
        return self._status(lookup)

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release_abandoned(
        self, lookup: _Lookup, call: asyncio.Future[PrefetchState]
    ) -> None:
        """Give back what a lookup locked after its caller went away (no session knows it)."""
        try:
            state = await call
        except Exception:  # storage failed the lookup, so it locked nothing
            return
        lookup.prefetch_id = state.prefetch_id
        if state.completed:
            self._complete(lookup, state, counted=False)
        try:
            await self._release_lookup(lookup)
        except Exception:
            logger.exception("releasing the locks of an abandoned lookup failed")

    def _late_status(self, lookup: _Lookup, call: asyncio.Future[PrefetchState]) -> None:
        """Record a prefetch status that arrived after its caller went away.

        Storage delivers a completed result once; recording it keeps the locks
        counted so EndSession or expiry releases them. A lookup released in the
        meantime is marked completed already and ignores it.
        """
        if call.cancelled() or call.exception() is not None:
            return
        state = call.result()
        if state.completed and not lookup.completed:
            self._complete(lookup, state)

    async def _poll(self, session: _Session, wait_ms: int) -> PrefetchStatus:
        lookup = session.lookup
        if lookup is None:
            raise NotFound(f"request {session.request_id!r} has no lookup", reason="NO_LOOKUP")
        if not lookup.completed:
            started = time.perf_counter()
            if self.storage.cancel_safe:
                state = await self.storage.prefetch_status(lookup.prefetch_id, wait_ms)
            else:
                call = asyncio.ensure_future(
                    self.storage.prefetch_status(lookup.prefetch_id, wait_ms)
                )
                try:
                    state = await asyncio.shield(call)
                except asyncio.CancelledError:
                    call.add_done_callback(functools.partial(self._late_status, lookup))
                    raise
            if wait_ms > 0:
                # An engine waiting for L2 loads (LMCache's lock/prefetch waits).
                self.counters.prefetch_waits += 1
                self.counters.prefetch_wait_seconds += time.perf_counter() - started
            if state.completed and not lookup.completed:
                self._complete(lookup, state)
        return self._status(lookup)

    def _existing_session(self, request_id: str) -> _Session:
        session = self._session(request_id, create=False)
        if session is None:
            raise NotFound(
                f"no session for request {request_id!r} (never looked up, ended or expired)",
                reason="UNKNOWN_REQUEST",
                metadata={"request_id": request_id},
            )
        return session

    async def query_prefetch_status(self, request_id: str) -> PrefetchStatus:
        """Non-blocking status of a request's lookup."""
        session = self._existing_session(request_id)
        lookup = session.lookup
        if lookup is not None and session.lock.locked():
            # Another call of this request holds the session, typically a parked
            # WaitPrefetchStatus: answer from what is known instead of queueing behind it.
            return self._status(lookup)
        async with session.lock:
            return await self._poll(session, 0)

    async def wait_prefetch_status(self, request_id: str, timeout_ms: int) -> PrefetchStatus:
        """Status of a request's lookup, waiting up to ``timeout_ms`` for completion."""
        self._check_wait(timeout_ms, "timeout_ms")
        session = self._existing_session(request_id)
        async with session.lock:
            return await self._poll(session, timeout_ms)

    def _chunk_range(self, start: int, end: int, n_tokens: int | None) -> tuple[int, int]:
        c = self.chunk_size
        if start % c or end % c:
            raise InvalidArgument(
                f"token range [{start}, {end}) is not aligned to the chunk size {c}",
                field="start_token" if start % c else "end_token",
            )
        if end < start:
            raise InvalidArgument(f"end_token {end} < start_token {start}", field="end_token")
        if n_tokens is not None and end > n_tokens:
            raise InvalidArgument(
                f"end_token {end} is beyond the request's {n_tokens} tokens", field="end_token"
            )
        return start // c, end // c

    async def free_lookup_locks(self, request_id: str, start_token: int, end_token: int) -> int:
        """Release the lookup locks held on chunks in [start_token, end_token)."""
        self._chunk_range(start_token, end_token, None)
        session = self._existing_session(request_id)
        async with session.lock:
            if session.lookup is None:
                raise NotFound(f"request {request_id!r} has no lookup", reason="NO_LOOKUP")
            first, last = self._chunk_range(start_token, end_token, session.tokens.size)
            status = await self._poll(session, 0)
            if not status.completed or first >= last:
                return 0
            return await self._release_remaining(session.lookup, first, last)

    async def end_session(self, request_id: str) -> tuple[bool, int]:
        """End a request: release what it still holds, refresh LRU of its chunks."""
        session = self._sessions.pop(request_id, None)
        if session is None:
            return False, 0
        async with session.lock:
            try:
                return True, await self._close_session(session, touch=True)
            except BaseException:
                # Storage did not take the release (unreachable): keep the session, so
                # the engine's retry, or the session's expiry, releases the locks later.
                self._sessions.setdefault(request_id, session)
                raise

    async def _close_session(self, session: _Session, touch: bool) -> int:
        lookup = session.lookup
        if lookup is None:
            return 0
        if touch and lookup.chunk_hashes and self.storage.cancel_safe:
            # In-process: no round trips to overlap, and two tasks would cost loop turns.
            released = await self._release_lookup(lookup)
            await self._touch(session.request_id, lookup)
        elif touch and lookup.chunk_hashes:
            # The LRU refresh does not depend on the release: one storage round trip
            # for both instead of two in a row (EndSession is on every request's path).
            released, _ = await asyncio.gather(
                self._release_lookup(lookup), self._touch(session.request_id, lookup)
            )
        else:
            released = await self._release_lookup(lookup)
        session.lookup = None
        return released

    async def _touch(self, request_id: str, lookup: _Lookup) -> None:
        grid = KeyGridSpec(
            lookup.model_name, lookup.cache_salt, lookup.kv_ranks(), lookup.chunk_hashes
        )
        try:
            await self.storage.touch(grid)
        except Exception:  # LRU recency only: never fails the release
            logger.warning("refreshing the LRU recency of request %s failed", request_id)

    # ------------------------------------------------------------------ transfers

    def _transfer_row(
        self, engine: _Engine, rng: PromptRangeSpec, session: _Session
    ) -> tuple[KeyRow, int, int]:
        spec = engine.spec
        if rng.model_name != spec.model_name or rng.world_size != spec.world_size:
            raise InvalidArgument(
                f"engine {spec.engine_id!r} serves {spec.model_name!r} with world size "
                f"{spec.world_size}, not {rng.model_name!r}/{rng.world_size}",
                field="range.model_name",
            )
        validate_cache_salt(rng.cache_salt, field="range.cache_salt")
        self._take_tokens(session, rng.token_ids)
        first, last = self._chunk_range(rng.start_token, rng.end_token, session.tokens.size)
        hashes = self._hashes(session, last)[first:last]
        row = KeyRow(
            spec.model_name, rng.cache_salt, worker_kv_rank(spec.world_size, spec.worker_id), hashes
        )
        return row, first, last

    def _check_block_ids(self, engine: _Engine, block_ids: Sequence[int], n_chunks: int) -> None:
        needed = n_chunks * (self.chunk_size // engine.spec.block_size)
        if len(block_ids) < needed:
            raise InvalidArgument(
                f"{n_chunks} chunks need {needed} block ids, got {len(block_ids)}",
                field="block_ids",
            )

    def _release_mask(
        self, session: _Session, rng: PromptRangeSpec, worker_id: int, first: int, last: int
    ) -> list[bool]:
        """Which chunks of the range hold a lookup lock of this worker (and consume it)."""
        lookup = session.lookup
        mask = [False] * (last - first)
        if (
            lookup is None
            or not lookup.completed
            or not lookup.matches(rng.model_name, rng.world_size, rng.cache_salt)
            or worker_id >= len(lookup.remaining)
        ):
            return mask
        row = lookup.remaining[worker_id]
        for c in range(first, min(last, lookup.hit_chunks)):
            if row[c] > 0:
                row[c] -= 1
                mask[c - first] = True
        return mask

    async def _restore_mask(
        self,
        session: _Session,
        lookup: _Lookup | None,
        worker_id: int,
        first: int,
        mask: Sequence[bool],
    ) -> None:
        """Count lookup locks consumed by a refused transfer as held again.

        Storage refused the call before releasing them; without this they
        would be released by no one until storage's read TTL. If the lookup
        has been replaced or ended since, nobody counts them any more, so they
        are released here.
        """
        if lookup is None or not any(mask):
            return
        async with session.lock:
            current = session.lookup is lookup and self._sessions.get(session.request_id) is session
            if current and worker_id < len(lookup.remaining):
                row = lookup.remaining[worker_id]
                for i, flag in enumerate(mask):
                    if flag:
                        row[first + i] += 1
                return
        hashes = [h for h, flag in zip(lookup.chunk_hashes[first:], mask, strict=False) if flag]
        grid = KeyGridSpec(
            lookup.model_name,
            lookup.cache_salt,
            [worker_kv_rank(lookup.world_size, worker_id)],
            hashes,
        )
        await self.storage.release_locks(grid, 1)

    async def store(
        self, engine_id: str, rng: PromptRangeSpec, block_ids: Sequence[int]
    ) -> StoreResult:
        """Copy the range's chunks from the engine's blocks into the cache."""
        engine = self._engine(engine_id, engine_driven=False)
        session = self._session(rng.request_id or f"anon-{uuid.uuid4().hex}", create=True)
        assert session is not None
        async with session.lock:
            row, first, last = self._transfer_row(engine, rng, session)
        self._check_block_ids(engine, block_ids, last - first)
        self.counters.stores += 1
        if last == first:
            return StoreResult(0, 0, 0)
        outcomes = await self.storage.store_chunks(engine_id, row, block_ids, self.chunk_size)
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
    ) -> int:
        """Copy the range's cached prefix into the engine's blocks; chunks retrieved."""
        engine = self._engine(engine_id, engine_driven=False)
        session = self._session(rng.request_id or f"anon-{uuid.uuid4().hex}", create=True)
        assert session is not None
        async with session.lock:
            row, first, last = self._transfer_row(engine, rng, session)
            if skip_first_n_tokens > rng.end_token - rng.start_token:
                raise InvalidArgument(
                    "skip_first_n_tokens is beyond the range", field="skip_first_n_tokens"
                )
            self._check_block_ids(engine, block_ids, last - first)
            lookup = session.lookup
            mask = self._release_mask(session, rng, engine.spec.worker_id, first, last)
        self.counters.retrieves += 1
        if last == first:
            return 0
        try:
            got = await self.storage.retrieve_chunks(
                engine_id, row, block_ids, self.chunk_size, skip_first_n_tokens, mask
            )
        except StorageRejected as rejected:
            await self._restore_mask(session, lookup, engine.spec.worker_id, first, mask)
            raise rejected.error from None
        self.counters.retrieved_chunks += got
        self.counters.retrieve_missed_chunks += (last - first) - got
        return got

    async def clear(self, force: bool) -> int:
        """Drop this node's L1 objects."""
        return await self.storage.clear(force)

    def report_block_allocation(self, engine_id: str, request_ids: Sequence[str]) -> None:
        """Count the scheduler's allocations (observability only)."""
        for request_id in request_ids:
            if not request_id:
                raise InvalidArgument(
                    "every block allocation needs a request_id", field="allocations.request_id"
                )
        self.counters.block_allocations += len(request_ids)
        if engine_id:
            self.ping(engine_id)

    # ------------------------------------------------------------ engine-driven

    async def prepare_store(self, engine_id: str, rng: PromptRangeSpec) -> PreparedSlots:
        """Reserve slots for the range's uncached chunks."""
        engine = self._engine(engine_id, engine_driven=True)
        session = self._session(rng.request_id or f"anon-{uuid.uuid4().hex}", create=True)
        assert session is not None
        async with session.lock:
            row, first, last = self._transfer_row(engine, rng, session)
        if last == first:
            return PreparedSlots("", [])
        return await self.storage.prepare_store(row, engine.chunk_bytes)

    async def commit_store(self, engine_id: str, transaction_id: str) -> int:
        """Publish a prepared store; a repeated commit (a retry) publishes nothing, harmlessly."""
        self._engine(engine_id, engine_driven=True)
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
        engine = self._engine(engine_id, engine_driven=True)
        session = self._session(rng.request_id or f"anon-{uuid.uuid4().hex}", create=True)
        assert session is not None
        async with session.lock:
            row, first, last = self._transfer_row(engine, rng, session)
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
        return prepared

    async def commit_retrieve(self, engine_id: str, transaction_id: str) -> int:
        """Release a prepared retrieve's locks and the lookup locks it used."""
        self._engine(engine_id, engine_driven=True)
        mask: list[bool] = []
        request_id = self._txn_sessions.pop(transaction_id, None)
        session = self._sessions.get(request_id) if request_id else None
        lookup: _Lookup | None = None
        worker = first = 0
        if session is not None:
            async with session.lock:
                info = session.retrieves.pop(transaction_id, None)
                if info is not None and session.lookup is not None:
                    worker, first, last = info
                    lookup = session.lookup
                    rng = PromptRangeSpec(
                        request_id or "", lookup.model_name, lookup.world_size,
                        lookup.cache_salt, session.tokens, first * self.chunk_size,
                        last * self.chunk_size,
                    )  # fmt: skip
                    mask = self._release_mask(session, rng, worker, first, last)
        try:
            released = await self.storage.commit_retrieve(transaction_id, mask)
        except StorageRejected as rejected:
            if session is not None:
                await self._restore_mask(session, lookup, worker, first, mask)
            raise rejected.error from None
        self.counters.retrieved_chunks += released
        return released

    # -------------------------------------------------------------- maintenance

    async def sweep(self) -> None:
        """Expire idle sessions (releasing their locks) and reap silent engines."""
        now = self._clock()
        expired = [
            s for s in list(self._sessions.values()) if now - s.last_used > self.session_ttl_s
        ]
        for session in expired:
            if self._sessions.get(session.request_id) is not session:
                continue
            del self._sessions[session.request_id]
            self.counters.sessions_expired += 1
            try:
                async with session.lock:
                    await self._close_session(session, touch=False)
            except Exception:
                # Kept (unless the request came back meanwhile): the next sweep retries.
                self._sessions.setdefault(session.request_id, session)
                logger.exception(
                    "releasing the locks of expired session %s failed", session.request_id
                )
        if self.engine_reap_s > 0:
            for engine_id, engine in list(self._engines.items()):
                if engine.pinged and now - engine.last_seen > self.engine_reap_s:
                    logger.warning(
                        "engine %s silent for %.0f s; unregistering it", engine_id,
                        now - engine.last_seen,
                    )  # fmt: skip
                    self.counters.engines_reaped += 1
                    try:
                        if engine.engine_driven:
                            self.unregister_engine_context(engine_id)
                        else:
                            await self.unregister_kv_cache(engine_id)
                    except Exception:
                        logger.exception("unregistering silent engine %s failed", engine_id)

    async def close(self, timeout: float = 5.0) -> None:
        """Let background lock releases finish (bounded), then cancel what is left."""
        pending = set(self._tasks)
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def stats(self) -> dict[str, object]:
        """Counters and gauges for metrics and status."""
        data: dict[str, object] = dict(vars(self.counters))
        data["active_sessions"] = len(self._sessions)
        data["registered_engines"] = len(self._engines)
        data["hash_memo_hits"] = self.hasher.memo_hits
        data["hash_memo_misses"] = self.hasher.memo_misses
        return data

    def engine_ids(self) -> list[str]:
        """Registered engines."""
        return sorted(self._engines)
