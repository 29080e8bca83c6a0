"""StorageNode: what a storage RPC does, as plain Python over the storage core.

It joins the :class:`~kvmesh.storage.core.manager.StorageManager` (L1, L2,
controllers), the :class:`~kvmesh.storage.core.transfer.TransferEngine` (the
engines' mapped KV memory) and the request-level bookkeeping the contract
promises: prefetch ids whose completed result is delivered once, engine-driven
transactions, per-chunk release of lookup locks, and the coordinator's node
commands (delete keys, set a quota, resync). The servicer converts protobuf
at the edge.

Threads (see the storage app's docstring for the whole process): every
method runs on the event loop, except the copies, which run on the copy
executor the app hands in (torch and the native kernel release the GIL), so
the loop keeps serving other RPCs meanwhile. A wait for a prefetch
(``wait_ms``) parks no thread at all: it awaits an asyncio future that the
prefetch controller's done callback resolves from its worker through
``loop.call_soon_threadsafe``, so any number of parked waits never delays a
store or a retrieve. An abandoned prefetch (released, or its lookup's caller
gone) gives its locks back from a done callback too.

Locking rules on the data path:
- a store reserves L1 objects, gathers into them, then publishes them; a
  failed copy discards the reservation at once (no wait for the write TTL);
- a retrieve read-locks each object for the duration of its copy, so
  eviction can never free memory under it, and separately releases the
  lookup locks the caller says it holds (``release_mask``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvmesh.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kvmesh.common.events import EventType, Tier
from kvmesh.common.keys import (
    ObjectKey,
    validate_cache_salt,
    validate_object_key,
    validate_object_keys,
)
from kvmesh.common.node_types import PrefetchState, Slot, StoreOutcome
from kvmesh.storage.core.controllers.prefetch import PrefetchHandle, PrefetchResult
from kvmesh.storage.core.l1.manager import L1Result
from kvmesh.storage.core.manager import L1_BACKEND, StorageManager
from kvmesh.storage.core.transfer import KVHandle, KVLayout, TransferEngine, chunk_nbytes

logger = logging.getLogger(__name__)

MAX_DELETE_KEYS = 10_000
MAX_CHUNK_BYTES = 1 << 31
PREPARE_TAG = "engine-driven"
_COMMITTED_KEPT = 4096

T = TypeVar("T")


def default_copy_threads() -> int:
    """Size of the copy executor: a thread per core, 2 to 8 (copies are memory-bound)."""
    return max(2, min(8, os.cpu_count() or 2))


@dataclass(slots=True)
class _Prefetch:
    handle: PrefetchHandle
    # Resolved on the event loop when the prefetch finishes; made by its first waiter.
    done: asyncio.Future[None] | None = None


@dataclass(frozen=True, slots=True)
class _ReadTxn:
    keys: list[ObjectKey]  # the keys asked for, in chunk order (release_mask indexes them)
    held: list[ObjectKey]  # the prefix this transaction read-locked


class StorageNode:
    """Request semantics of ``kvmesh.storage.v1.StorageService`` over the storage core."""

    def __init__(
        self,
        manager: StorageManager,
        transfer: TransferEngine,
        *,
        max_chunks_per_request: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        copy_executor: Executor | None = None,
    ) -> None:
        """``copy_executor`` runs the gathers and scatters (the app sizes it); None = own."""
        self.manager = manager
        self._clock = clock
        self._txn_deadlines: dict[str, float] = {}
        self.transfer = transfer
        self.max_chunks = max_chunks_per_request
        self._prefetches: dict[str, _Prefetch] = {}
        self._ids = itertools.count(1)
        self._store_txns: dict[str, list[ObjectKey]] = {}
        self._read_txns: dict[str, _ReadTxn] = {}
        # Recently committed retrieve transactions, so a repeated commit answers 0.
        # Recently committed transactions, so a retried commit is harmless (idempotent).
        self._committed: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._owns_copies = copy_executor is None
        self._copies = copy_executor or ThreadPoolExecutor(
            max_workers=default_copy_threads(), thread_name_prefix="kvmesh-transfer"
        )
        self.waiting = 0  # prefetch waits parked right now (loop thread only)

    # ----------------------------------------------------------------- engines

    def register_engine(
        self, engine_id: str, layout: KVLayout, handles: Sequence[KVHandle]
    ) -> bool:
        """Map an engine's KV memory; True when it was registered already (same layout)."""
        if not engine_id:
            raise InvalidArgument("engine_id must not be empty", field="engine_id")
        already = self.transfer.is_registered(engine_id)
        try:
            self.transfer.register(engine_id, layout, handles)
        except FailedPrecondition as exc:
            if already:
                raise AlreadyExists(
                    f"engine {engine_id!r} is registered with a different layout or memory; "
                    "unregister it first",
                    reason="ENGINE_LAYOUT_MISMATCH",
                ) from exc
            raise
        return already

    def unregister_engine(self, engine_id: str) -> bool:
        """Unmap an engine's memory; False when it was not registered."""
        if not self.transfer.is_registered(engine_id):
            return False
        self.transfer.unregister(engine_id)
        return True

    def _layout(self, engine_id: str) -> KVLayout:
        if not self.transfer.is_registered(engine_id):
            raise FailedPrecondition(
                f"engine {engine_id!r} has not registered its KV memory with this node",
                reason="ENGINE_NOT_REGISTERED",
                metadata={"engine_id": engine_id},
            )
        return self.transfer.layout(engine_id)

    def _check_keys(self, keys: Sequence[ObjectKey], field: str = "keys") -> None:
        if len(keys) > self.max_chunks:
            raise InvalidArgument(
                f"{len(keys)} chunks exceed this node's limit of {self.max_chunks} per request",
                field=field,
            )
        validate_object_keys(keys, field)

    def _check_grid_keys(self, keys: Sequence[ObjectKey]) -> None:
        # A flattened KeyGrid (lock release, touch): same bound as a lookup's grid.
        if len(keys) > self.max_chunks * 8:
            raise InvalidArgument("the key grid is too large", field="keys")
        validate_object_keys(keys, "keys")

    def _chunk_blocks(
        self, layout: KVLayout, n_chunks: int, block_ids: Sequence[int], chunk_tokens: int
    ) -> list[list[int]]:
        if chunk_tokens < 1 or chunk_tokens % layout.block_size:
            raise InvalidArgument(
                f"chunk_tokens {chunk_tokens} is not a positive multiple of the engine's block "
                f"size {layout.block_size}",
                field="chunk_tokens",
            )
        per_chunk = chunk_tokens // layout.block_size
        if len(block_ids) < n_chunks * per_chunk:
            raise InvalidArgument(
                f"{n_chunks} chunks need {n_chunks * per_chunk} block ids, got {len(block_ids)}",
                field="block_ids",
            )
        for i, block in enumerate(block_ids[: n_chunks * per_chunk]):
            if not 0 <= block < layout.num_blocks:
                raise InvalidArgument(
                    f"block_ids[{i}] = {block} is outside the engine's {layout.num_blocks} blocks",
                    field="block_ids",
                )
        return [list(block_ids[i * per_chunk : (i + 1) * per_chunk]) for i in range(n_chunks)]

    # ------------------------------------------------------------------ stores

    async def store_chunks(
        self,
        engine_id: str,
        keys: Sequence[ObjectKey],
        block_ids: Sequence[int],
        chunk_tokens: int,
    ) -> list[StoreOutcome]:
        """Gather each chunk into a new L1 object and publish it; one outcome per key."""
        layout = self._layout(engine_id)
        self._check_keys(keys)
        blocks = self._chunk_blocks(layout, len(keys), block_ids, chunk_tokens)
        if not keys:
            return []
        nbytes = chunk_nbytes(layout, chunk_tokens)
        present = self.manager.l1.contains(keys)
        reserved = self.manager.reserve_write(keys, nbytes)
        todo = [i for i, key in enumerate(keys) if key in reserved]
        if todo:
            chosen = [keys[i] for i in todo]
            try:
                await self._copy(
                    functools.partial(
                        self.transfer.gather_chunks,
                        engine_id,
                        [blocks[i] for i in todo],
                        [chunk_tokens] * len(todo),
                        [reserved[k].view() for k in chosen],
                    )
                )
            except BaseException:
                self.manager.abort_write(chosen)
                raise
            self.manager.finish_write(chosen)
        outcomes = []
        for i, key in enumerate(keys):
            if key in reserved:
                outcomes.append(StoreOutcome.STORED)
            elif present[i]:
                outcomes.append(StoreOutcome.ALREADY_CACHED)
            else:
                # Being written by someone else right now counts as cached; otherwise no room.
                cached = self.manager.l1.contains([key])[0]
                outcomes.append(StoreOutcome.ALREADY_CACHED if cached else StoreOutcome.NO_MEMORY)
        return outcomes

    async def _copy(self, copy: Callable[[], T]) -> T:
        """Run a copy on the copy executor; return only once it no longer touches memory.

        A copy cannot be interrupted: a caller cancelled meanwhile still waits
        for it (then re-raises), so the L1 objects and locks it uses are never
        given back under it.
        """
        future = asyncio.get_running_loop().run_in_executor(self._copies, copy)
        cancelled = False
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            if not future.cancelled():
                future.exception()  # retrieved: nobody is left to report it to
            raise asyncio.CancelledError
        return future.result()

    # ---------------------------------------------------------------- lookups

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def _finished(self, prefetch_id: str, result: PrefetchResult) -> PrefetchState:
        rows = max(result.num_rows, 1)
        l2_chunks = -(-result.l2_hit_cells // rows) if result.l2_hit_cells else 0
        return PrefetchState(
            prefetch_id,
            True,
            result.hit_chunks,
            max(result.hit_chunks - l2_chunks, 0),
            min(l2_chunks, result.hit_chunks),
        )

    async def lookup_and_lock(
        self,
        request_id: str,
        rows: Sequence[Sequence[ObjectKey]],
        readers: int,
        wait_ms: int,
        chunk_bytes: int = 0,
    ) -> PrefetchState:
        """Lock the prefix present in every row (loading L2 hits); maybe wait for it.

        ``chunk_bytes`` (0 = unknown) sizes L2 objects this node has not indexed
        (written by another node of a shared pool since this one started).
        """
        if not rows:
            raise InvalidArgument("the key grid has no kv_ranks", field="keys.kv_ranks")
        width = len(rows[0])
        if width * len(rows) > self.max_chunks * 8:
            raise InvalidArgument("the key grid is too large", field="keys")
        for r, row in enumerate(rows):
            self._check_keys(row, field=f"keys.rows[{r}]")
        if readers > 128:
            raise InvalidArgument("num_kv_readers must be <= 128", field="num_kv_readers")
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise InvalidArgument("chunk_bytes is too large", field="chunk_bytes")
        row_nbytes = [chunk_bytes] * len(rows) if chunk_bytes else None
        handle = self.manager.submit_prefetch(
            request_id, rows, max(readers, 1), row_nbytes=row_nbytes
        )
        prefetch_id = self._new_id("prefetch")
        with self._lock:
            self._prefetches[prefetch_id] = _Prefetch(handle)
        try:
            return await self.prefetch_status(prefetch_id, wait_ms)
        except asyncio.CancelledError:
            # The caller went away while waiting and never learned the prefetch id, so
            # nobody else could release its locks before the read TTL: give them back.
            self.release_prefetch(prefetch_id)
            raise

    async def prefetch_status(self, prefetch_id: str, wait_ms: int) -> PrefetchState:
        """Status of a prefetch; a completed result is delivered once, then forgotten."""
        with self._lock:
            entry = self._prefetches.get(prefetch_id)
        if entry is None:
            raise NotFound(
                f"unknown prefetch {prefetch_id!r} (never started, delivered or released)",
                reason="UNKNOWN_PREFETCH",
            )
        result = self.manager.query_prefetch(entry.handle)
        if result is None and wait_ms > 0:
            await self._wait_done(entry, wait_ms / 1000.0)
            result = self.manager.query_prefetch(entry.handle)
        if result is None:
            return PrefetchState(prefetch_id, False)
        with self._lock:
            self._prefetches.pop(prefetch_id, None)
        return self._finished(prefetch_id, result)

    async def _wait_done(self, entry: _Prefetch, timeout: float) -> None:
        """Wait until the prefetch finishes or ``timeout`` seconds pass, parking no thread."""
        loop = asyncio.get_running_loop()
        if entry.done is None or entry.done.get_loop() is not loop:
            done: asyncio.Future[None] = loop.create_future()
            self.manager.prefetch.add_done_callback(
                entry.handle, functools.partial(_resolve_threadsafe, loop, done)
            )
            entry.done = done
        self.waiting += 1
        try:
            # Shielded: a waiter that times out or goes away leaves the future to the others.
            await asyncio.wait_for(asyncio.shield(entry.done), timeout)
        except TimeoutError:
            pass
        finally:
            self.waiting -= 1

    def release_prefetch(self, prefetch_id: str) -> bool:
        """Abandon a prefetch: its locks are released as soon as it finishes (now if it has)."""
        with self._lock:
            entry = self._prefetches.pop(prefetch_id, None)
        if entry is None:
            return False
        # NotFound: its result expired unqueried, and the controller released its locks then.
        with contextlib.suppress(NotFound):
            self.manager.prefetch.add_done_callback(entry.handle, self._release_abandoned)
        return True

    def _release_abandoned(self, handle: PrefetchHandle) -> None:
        """Done callback of an abandoned prefetch (its worker's thread): give the locks back."""
        try:
            result = self.manager.query_prefetch(handle)
        except NotFound:
            return  # expired meanwhile (locks released by the controller)
        if result is not None:
            self.manager.finish_read(result.locked_keys, result.num_kv_readers)

    # -------------------------------------------------------------- retrieves

    async def retrieve_chunks(
        self,
        engine_id: str,
        keys: Sequence[ObjectKey],
        block_ids: Sequence[int],
        chunk_tokens: int,
        skip_first_n_tokens: int,
        release_mask: Sequence[bool],
    ) -> int:
        """Scatter the resident prefix of ``keys`` into the engine; chunks copied."""
        layout = self._layout(engine_id)
        self._check_keys(keys)
        if len(release_mask) > len(keys):
            raise InvalidArgument(
                "release_lookup_locks has more entries than keys", field="release_lookup_locks"
            )
        if skip_first_n_tokens > len(keys) * chunk_tokens:
            raise InvalidArgument(
                "skip_first_n_tokens is beyond the chunks", field="skip_first_n_tokens"
            )
        blocks = self._chunk_blocks(layout, len(keys), block_ids, chunk_tokens)
        nbytes = chunk_nbytes(layout, chunk_tokens)
        results = self.manager.reserve_read(keys, 1) if keys else []
        prefix = 0
        while prefix < len(keys) and results[prefix] is L1Result.SUCCESS:
            prefix += 1
        locked = [k for k, r in zip(keys, results, strict=True) if r is L1Result.SUCCESS]
        try:
            objects = self.manager.unsafe_read(keys[:prefix])
            usable = 0
            while usable < prefix and objects.get(keys[usable]) is not None:
                if objects[keys[usable]].size != nbytes:
                    logger.warning(
                        "object %s holds %d bytes, the engine's chunk is %d; treating as a miss",
                        keys[usable].describe(),
                        objects[keys[usable]].size,
                        nbytes,
                    )
                    break
                usable += 1
            if usable:
                await self._copy(
                    functools.partial(
                        self.transfer.scatter_chunks,
                        engine_id,
                        blocks[:usable],
                        [chunk_tokens] * usable,
                        [objects[k].view() for k in keys[:usable]],
                        skip_first_n_tokens,
                    )
                )
        finally:
            self.manager.finish_read(locked, 1)
            flagged = [k for k, flag in zip(keys, release_mask, strict=False) if flag]
            if flagged:
                self.manager.finish_read(flagged, 1)
        if usable:
            # A served chunk is a use: refresh its LRU recency and report ACCESS, so the
            # coordinator's access counts follow real reuse.
            self.manager.touch(keys[:usable])
        return usable

    # ------------------------------------------------------------ locks & misc

    def release_locks(self, keys: Sequence[ObjectKey], count: int) -> tuple[int, int]:
        """Release ``count`` read locks per key; (released, skipped)."""
        self._check_grid_keys(keys)
        results = self.manager.finish_read(keys, max(count, 1))
        released = sum(1 for r in results if r is L1Result.SUCCESS)
        return released, len(results) - released

    def touch(self, keys: Sequence[ObjectKey]) -> int:
        """Refresh LRU recency of resident keys."""
        self._check_grid_keys(keys)
        return self.manager.touch(keys)

    def delete(
        self, keys: Sequence[ObjectKey], tier: Tier | None, backend: str, force: bool
    ) -> tuple[int, int]:
        """Delete keys from a tier (None = both); (deleted, skipped)."""
        if len(keys) > MAX_DELETE_KEYS:
            raise InvalidArgument(
                f"at most {MAX_DELETE_KEYS} keys per delete, got {len(keys)}", field="keys"
            )
        for i, key in enumerate(keys):
            validate_object_key(key, field=f"keys[{i}]")
        if backend:
            names = {t.backend for t in self.manager.tiers} | {t.name for t in self.manager.tiers}
            if tier is Tier.L1 or (backend not in names and backend != L1_BACKEND):
                raise InvalidArgument(
                    f"unknown backend {backend!r}; this node has {sorted(names)}",
                    field="backend",
                )
        # Counted per key and tier: absent keys count as skipped (the contract).
        deleted = 0
        tiers = 0
        if tier in (None, Tier.L1):
            deleted += self.manager.delete(keys, Tier.L1, force=force)[0]
            tiers += 1
        if tier in (None, Tier.L2):
            deleted += self.manager.delete(keys, Tier.L2, force=force, backend=backend)[0]
            tiers += sum(
                1 for t in self.manager.tiers if not backend or backend in (t.backend, t.name)
            )
        return deleted, len(keys) * tiers - deleted

    def clear(self, force: bool) -> int:
        """Drop L1 objects (locked ones too with force)."""
        deleted, _ = self.manager.clear(force=force)
        return deleted

    # ---------------------------------------------------------- engine-driven

    def _check_chunk_bytes(self, chunk_bytes: int) -> None:
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]", field="chunk_bytes"
            )

    def prepare_store(
        self, keys: Sequence[ObjectKey], chunk_bytes: int
    ) -> tuple[str, list[Slot], int, int]:
        """Reserve slots for uncached keys: (transaction, slots, cached, skipped)."""
        self._check_keys(keys)
        self._check_chunk_bytes(chunk_bytes)
        present = self.manager.l1.contains(keys)
        reserved = self.manager.reserve_write(keys, chunk_bytes, tag=PREPARE_TAG)
        slots = []
        for i, key in enumerate(keys):
            obj = reserved.get(key)
            if obj is not None:
                where = obj.location()
                slots.append(Slot(i, where.path, where.offset, where.size))
        cached = sum(1 for p in present if p)
        skipped = len(keys) - cached - len(slots)
        if not slots:
            if skipped:
                raise ResourceExhausted("no chunk fits in L1 right now", reason="L1_FULL")
            return "", [], cached, 0
        txn = self._new_id("store")
        with self._lock:
            self._store_txns[txn] = [k for k in keys if k in reserved]
            self._txn_deadlines[txn] = self._clock() + self.manager.l1.write_ttl_s
        return txn, slots, cached, skipped

    def commit_store(self, transaction_id: str) -> int:
        """Publish a prepared store. A repeated commit (lost reply) publishes nothing more."""
        with self._lock:
            keys = self._store_txns.pop(transaction_id, None)
            self._txn_deadlines.pop(transaction_id, None)
            repeat = keys is None and transaction_id in self._committed
            if keys is not None:
                self._remember_committed(transaction_id)
        if repeat:
            return 0
        if keys is None:
            raise NotFound(
                f"unknown store transaction {transaction_id!r}", reason="UNKNOWN_TRANSACTION"
            )
        results = self.manager.finish_write(keys, tag=PREPARE_TAG)
        return sum(1 for r in results if r is L1Result.SUCCESS)

    def prepare_retrieve(
        self, keys: Sequence[ObjectKey], chunk_bytes: int
    ) -> tuple[str, list[Slot]]:
        """Read-lock the resident prefix and return its slots."""
        self._check_keys(keys)
        self._check_chunk_bytes(chunk_bytes)
        results = self.manager.reserve_read(keys, 1) if keys else []
        prefix = 0
        while prefix < len(keys) and results[prefix] is L1Result.SUCCESS:
            prefix += 1
        beyond = [
            k for k, r in zip(keys[prefix:], results[prefix:], strict=True) if r is L1Result.SUCCESS
        ]
        if beyond:
            self.manager.finish_read(beyond, 1)
        objects = self.manager.unsafe_read(keys[:prefix])
        slots = []
        held = []
        for i, key in enumerate(keys[:prefix]):
            obj = objects.get(key)
            if obj is None or obj.size != chunk_bytes:
                break
            where = obj.location()
            slots.append(Slot(i, where.path, where.offset, where.size))
            held.append(key)
        unused = keys[len(held) : prefix]
        if unused:
            self.manager.finish_read(unused, 1)
        if not held:
            return "", []
        txn = self._new_id("read")
        with self._lock:
            self._read_txns[txn] = _ReadTxn(list(keys), held)
            self._txn_deadlines[txn] = self._clock() + self.manager.l1.read_ttl_s
        return txn, slots

    def commit_retrieve(self, transaction_id: str, release_mask: Sequence[bool]) -> int:
        """Release a prepared retrieve's locks and the flagged lookup locks."""
        with self._lock:
            txn = self._read_txns.pop(transaction_id, None)
            self._txn_deadlines.pop(transaction_id, None)
            repeat = txn is None and transaction_id in self._committed
            if txn is not None:
                self._remember_committed(transaction_id)
        if repeat:
            return 0  # a retried commit (lost reply): idempotent, releases nothing
        if txn is None:
            raise NotFound(
                f"unknown retrieve transaction {transaction_id!r}", reason="UNKNOWN_TRANSACTION"
            )
        self.manager.finish_read(txn.held, 1)
        flagged = [k for k, flag in zip(txn.keys, release_mask, strict=False) if flag]
        if flagged:
            self.manager.finish_read(flagged, 1)
        return len(txn.held)

    def _remember_committed(self, transaction_id: str) -> None:
        """Call with ``self._lock`` held."""
        self._committed[transaction_id] = None
        while len(self._committed) > _COMMITTED_KEPT:
            self._committed.popitem(last=False)

    def expire_transactions(self) -> int:
        """Forget engine-driven transactions older than their lock TTL (engine gone).

        An expired store's reservation is discarded at once; an expired
        retrieve's read locks have lapsed already (TTL locks). A later commit
        of either is NOT_FOUND. Returns how many expired.
        """
        now = self._clock()
        with self._lock:
            expired = [t for t, deadline in self._txn_deadlines.items() if deadline <= now]
            stores = []
            for txn in expired:
                del self._txn_deadlines[txn]
                keys = self._store_txns.pop(txn, None)
                if keys is not None:
                    stores.append(keys)
                self._read_txns.pop(txn, None)
        for keys in stores:
            self.manager.abort_write(keys, tag=PREPARE_TAG)
        if expired:
            logger.warning("%d engine-driven transactions expired uncommitted", len(expired))
        self._forget_expired_prefetches()
        return len(expired)

    def _forget_expired_prefetches(self) -> None:
        """Forget prefetch ids whose result expired unqueried (the controller freed its locks)."""
        self.manager.prefetch.sweep()
        with self._lock:
            entries = list(self._prefetches.items())
        gone = [pid for pid, e in entries if not self.manager.prefetch.known(e.handle)]
        if gone:
            with self._lock:
                for pid in gone:
                    self._prefetches.pop(pid, None)
            logger.info("forgot %d prefetches whose results expired unqueried", len(gone))

    # -------------------------------------------------------------- commands

    def handle_command(self, command: Any) -> int:
        """Execute a coordinator command (the emitter's CommandHandler protocol)."""
        from kvmesh.storage.core.ports import (
            DeleteKeysCommand,
            QuotaChangedCommand,
            ResyncCommand,
        )

        if isinstance(command, DeleteKeysCommand):
            deleted, _ = self.delete(command.keys, command.tier, command.backend, command.force)
            return deleted
        if isinstance(command, QuotaChangedCommand):
            return self.apply_quota(command.cache_salt, command.tier, command.quota_bytes)
        if isinstance(command, ResyncCommand):
            return self.resync(command.tier)
        raise InvalidArgument(f"unknown command {type(command).__name__}")

    def apply_quota(self, cache_salt: str, tier: Tier, limit_bytes: int | None) -> int:
        """Set (or with None remove) one tier of a salt's quota."""
        current = self.manager.get_quota(cache_salt)
        l1 = current.l1_bytes if current else None
        l2 = current.l2_bytes if current else None
        if tier is Tier.L1:
            l1 = limit_bytes
        elif tier is Tier.L2:
            l2 = limit_bytes
        else:
            raise InvalidArgument("a quota's tier must be L1 or L2", field="tier")
        if l1 is None and l2 is None:
            self.manager.delete_quota(cache_salt)
        else:
            self.manager.set_quota(cache_salt, l1_bytes=l1, l2_bytes=l2)
        return 1

    def resync(self, tier: Tier | None) -> int:
        """Re-announce every placement this node holds (after a coordinator cold start)."""
        announced = 0
        sink = self.manager.event_sink
        if tier in (None, Tier.L1) and sink is not None:
            keys = self.manager.l1.resident_keys()
            entries = [(k, self.manager.l1.size_of(k) or 0) for k in keys]
            for start in range(0, len(entries), 1024):
                sink.record(
                    EventType.STORE, Tier.L1, L1_BACKEND, False, entries[start : start + 1024]
                )
            announced += len(entries)
        if tier in (None, Tier.L2):
            for l2 in self.manager.tiers:
                announced += l2.rebuild_index()
        return announced

    # ---------------------------------------------------------------- quotas

    @staticmethod
    def check_salt(cache_salt: str) -> None:
        """InvalidArgument unless the salt is usable in a key."""
        validate_cache_salt(cache_salt)

    def salt_usage(self, cache_salt: str, tier: Tier) -> tuple[int, int | None]:
        """(bytes the salt holds on the tier, its explicit limit or None)."""
        if tier is Tier.L1:
            used = self.manager.l1.bytes_by_salt().get(cache_salt, 0)
        else:
            used = sum(t.index.bytes_by_salt().get(cache_salt, 0) for t in self.manager.tiers)
        quota = self.manager.get_quota(cache_salt)
        limit = None
        if quota is not None:
            limit = quota.l1_bytes if tier is Tier.L1 else quota.l2_bytes
        return used, limit

    def salts(self, tier: Tier) -> list[str]:
        """Salts with bytes on the tier or a quota for it."""
        if tier is Tier.L1:
            found = set(self.manager.l1.bytes_by_salt())
        else:
            found = {s for t in self.manager.tiers for s in t.index.bytes_by_salt()}
        for salt, quota in self.manager.list_quotas().items():
            if (quota.l1_bytes if tier is Tier.L1 else quota.l2_bytes) is not None:
                found.add(salt)
        return sorted(found)

    def list_objects(
        self, tier: Tier | None, backend: str, model_name: str
    ) -> list[tuple[ObjectKey, Tier, str, int]]:
        """Objects held by this node (a snapshot), L1 first, then each adapter."""
        out: list[tuple[ObjectKey, Tier, str, int]] = []
        if tier in (None, Tier.L1) and backend in ("", L1_BACKEND):
            for key in self.manager.l1.resident_keys():
                size = self.manager.l1.size_of(key)
                if size is not None and (not model_name or key.model_name == model_name):
                    out.append((key, Tier.L1, L1_BACKEND, size))
        if tier in (None, Tier.L2):
            for l2 in self.manager.tiers:
                if backend and backend not in (l2.backend, l2.name):
                    continue
                for key, size in l2.index.items():
                    if not model_name or key.model_name == model_name:
                        out.append((key, Tier.L2, l2.backend, size))
        return out

    # ---------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        """The manager's status plus node-level counters."""
        data = self.manager.status()
        with self._lock:
            data["active_prefetches"] = len(self._prefetches)
            data["open_transactions"] = len(self._store_txns) + len(self._read_txns)
        data["waiting_calls"] = self.waiting
        data["engines"] = self.transfer.instance_ids()
        return data

    def close(self) -> None:
        """Stop the copy executor if the node made it (the app closes the one it passed in).

        Waits for running copies; the manager and transfer engine close separately, after.
        """
        if self._owns_copies:
            self._copies.shutdown(wait=True)


def _resolve_threadsafe(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], _handle: PrefetchHandle
) -> None:
    """A prefetch's done callback (on its worker): resolve ``future`` on its own loop."""
    # RuntimeError: the loop is closed, so nobody is waiting any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_set_done, future)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
