"""StorageManager: the storage node's core, as the gRPC servicer (and tests) call it.

It wires the L1 pool and state machine, the L2 adapters (each behind an
:class:`L2Tier`), eviction, the store and prefetch controllers, quotas, and
placement events. Plain typed Python: no protobuf, no grpc.

Every placement change is reported to an :class:`EventSink` in the order it
happened: L1 admit (STORE/L1), L1 delete, eviction or release (DELETE/L1),
L1 use (ACCESS/L1), L2 store (STORE/L2), L2 delete or eviction (DELETE/L2),
L2 load into L1 (ACCESS/L2 plus STORE/L1 of the loaded object), and, at
start, everything each adapter already holds (STORE/L2), so the coordinator
relearns this node's L2 placements after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.controllers.l2index import L2Indexer
from kvmesh.storage.core.controllers.l2tier import L2Tier, make_tiers
from kvmesh.storage.core.controllers.prefetch import PrefetchController
from kvmesh.storage.core.controllers.prefetch_job import PrefetchHandle
from kvmesh.storage.core.controllers.prefetch_types import PrefetchResult
from kvmesh.storage.core.controllers.store import (
    StoreController,
)
from kvmesh.storage.core.eviction import (
    EvictionController,
    Quota,
    QuotaManager,
)
from kvmesh.storage.core.l1.manager import (
    STORE_TAG,
    L1Manager,
)
from kvmesh.storage.core.l1.objects import L1Object
from kvmesh.storage.core.l1.pool import L1Pool
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.l1_events import L1_BACKEND, L1EventBridge
from kvmesh.storage.core.l2.base import L2Adapter, L2Unavailable
from kvmesh.storage.core.options import StorageOptions
from kvmesh.storage.core.pins import PinTable
from kvmesh.storage.core.ports import CapacityModule, EventSink

logger = logging.getLogger(__name__)

#: An unqueried prefetch result releases its locks this share of the read TTL after it
#: is published, so the node's sweep gets to it before they lapse.
RESULT_SHARE_OF_READ_TTL = 0.8


class StorageManager:
    """Facade of the storage node: L1 writes and reads, prefetch, deletes, quotas, status.

    Threads (all daemon, all stopped and joined by :meth:`close`): the pool
    grower and the two eviction loops (when ``background_threads``), the
    store dispatcher with its per-adapter I/O pool, the prefetch worker
    pool, and a start-up thread that indexes each adapter.
    """

    def __init__(
        self,
        instance_id: str,
        l1_capacity_bytes: int,
        *,
        l2_adapters: Sequence[L2Adapter] = (),
        event_sink: EventSink | None = None,
        options: StorageOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        opts = options or StorageOptions()
        self.instance_id = instance_id
        self.options = opts
        self._sink = event_sink
        self._closed = False
        self._close_lock = threading.Lock()
        #: Reservations on an event loop that left a growth to the background grower.
        #: Reservations on an event loop that asked the grower for a segment instead
        #: of growing there; and the store calls that waited for a growth (make_room).
        self.loop_growths_deferred = 0
        self.growth_waits = 0
        self.growth_wait_max_s = 0.0
        self.pool = L1Pool(
            instance_id,
            l1_capacity_bytes,
            segment_bytes=opts.segment_bytes,
            shm_dir=opts.shm_dir,
            initial_bytes=opts.initial_l1_bytes,
            grow_watermark=opts.grow_watermark,
            prefault=opts.prefault,
            background_grow=opts.background_threads,
            full_chunk_bytes=opts.full_chunk_bytes,
        )
        try:
            self.l1 = L1Manager(
                self.pool, read_ttl_s=opts.read_ttl_s, write_ttl_s=opts.write_ttl_s, clock=clock
            )
            self.tiers = make_tiers(
                l2_adapters,
                event_sink,
                backoff_s=opts.l2_backoff_s,
                max_backoff_s=opts.l2_max_backoff_s,
                clock=clock,
            )
            self.pins = PinTable()
            self.quotas = QuotaManager(opts.default_quota)
            self.eviction = EvictionController(
                self.l1,
                self.pool,
                self.quotas,
                self.pins,
                tiers=self.tiers,
                l2_configs=opts.l2_eviction,
                period_s=opts.eviction_period_s,
                trigger_watermark=opts.trigger_watermark,
                target_watermark=opts.target_watermark,
            )
            self.store = StoreController(
                self.l1,
                self.tiers,
                policy=opts.store_policy,
                batch_max_keys=opts.store_batch_keys,
                max_pending_keys=opts.store_max_pending_keys,
            )
            self.prefetch = PrefetchController(
                self.l1,
                self.tiers,
                self.pins,
                policy=opts.prefetch_policy,
                max_in_flight=opts.prefetch_max_in_flight,
                # Unqueried results release their locks before those could lapse.
                result_ttl_s=RESULT_SHARE_OF_READ_TTL * opts.read_ttl_s,
                clock=clock,
            )
        except BaseException:
            self.pool.close()
            raise
        # Events first, so a listener further down can never report a change
        # before the coordinator has heard of it.
        if event_sink is not None:
            self.l1.add_listener(L1EventBridge(event_sink))
        self.l1.add_listener(self.eviction.policy)
        self.l1.add_listener(self.store)
        self.l1.set_reclaim(self._reclaim)

        self._indexer = L2Indexer(
            self.tiers,
            index_contents=opts.index_l2_at_start,
            backoff_s=opts.l2_backoff_s,
            on_progress=self.publish_capacity,
        )
        self.publish_capacity()
        self.store.start()
        if opts.background_threads:
            self.eviction.start()
        self._indexer.start()

    @property
    def event_sink(self) -> EventSink | None:
        """Where placement changes are reported (None when the node runs alone)."""
        return self._sink

    # -- writes ---------------------------------------------------------------

    def reserve_write(
        self,
        keys: Sequence[ObjectKey],
        nbytes_per_key: int | Sequence[int],
        *,
        tag: str = STORE_TAG,
    ) -> dict[ObjectKey, L1Object]:
        """Reserve an L1 object per key for a client write.

        Keys already resident, being written, or that do not fit even after
        eviction are omitted from the answer (not an error). Keys are assumed
        validated by the caller (the servicer validates at the edge).
        """
        self._check_open()
        sizes = (
            [nbytes_per_key] * len(keys)
            if isinstance(nbytes_per_key, int)
            else list(nbytes_per_key)
        )
        if len(sizes) != len(keys):
            raise InvalidArgument("one size per key is required", field="nbytes_per_key")
        _, objects = self.l1.reserve_write(keys, sizes, tag=tag)
        return objects

    def finish_write(self, keys: Sequence[ObjectKey], *, tag: str = STORE_TAG) -> list[L1Result]:
        """Publish written objects: they become readable and are written through to L2."""
        return self.l1.finish_write(keys, tag=tag)

    def abort_write(self, keys: Sequence[ObjectKey], *, tag: str = STORE_TAG) -> list[L1Result]:
        """Discard reserved objects whose transfer failed (instead of waiting for the TTL)."""
        return self.l1.finish_write_and_delete(keys, tag=tag)

    # -- lookup / prefetch ---------------------------------------------------------

    def submit_prefetch(
        self,
        request_id: str,
        key_rows: Sequence[Sequence[ObjectKey]],
        num_kv_readers: int,
        *,
        row_nbytes: Sequence[int] | None = None,
        allow_peers: bool = True,
    ) -> PrefetchHandle:
        """Look the grid up in L1 and L2 and load the missing prefix; see PrefetchController."""
        self._check_open()
        return self.prefetch.submit(
            request_id, key_rows, num_kv_readers, row_nbytes=row_nbytes, allow_peers=allow_peers
        )

    def query_prefetch(self, handle: PrefetchHandle) -> PrefetchResult | None:
        """The result, exactly once; None while running; NotFound when unknown or consumed."""
        return self.prefetch.query(handle)

    def wait_prefetch(self, handle: PrefetchHandle, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the result (does not consume it)."""
        return self.prefetch.wait(handle, timeout)

    # -- reads ----------------------------------------------------------------

    def unsafe_read(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, L1Object]:
        """Objects of keys the caller holds read locks on (from a prefetch); others are absent."""
        _, objects = self.l1.unsafe_read(keys)
        return objects

    def reserve_read(self, keys: Sequence[ObjectKey], n: int = 1) -> list[L1Result]:
        """Take ``n`` read locks on resident keys (e.g. for an engine-driven read)."""
        return self.l1.reserve_read(keys, n)

    def finish_read(self, keys: Sequence[ObjectKey], n: int = 1) -> list[L1Result]:
        """Release ``n`` read locks per key."""
        return self.l1.finish_read(keys, n)

    def touch(self, keys: Sequence[ObjectKey]) -> int:
        """Refresh LRU recency of resident keys (end of a session); returns how many were."""
        return self.l1.touch(keys)

    # -- deletes --------------------------------------------------------------

    def delete(
        self,
        keys: Sequence[ObjectKey],
        tier: Tier | None = None,
        *,
        force: bool = False,
        backend: str = "",
    ) -> tuple[int, int]:
        """Delete keys from L1, L2 or both (``tier=None``); returns ``(deleted, skipped)``.

        Counted per key and tier. Skipped: locked in L1, pinned by a running
        prefetch in L2 (both overridden by ``force``), or on a degraded
        adapter. ``backend`` limits the L2 part to one adapter (by backend or
        adapter name).
        """
        deleted = skipped = 0
        if tier in (None, Tier.L1):
            for res in self.l1.delete(keys, force=force):
                if res is L1Result.SUCCESS:
                    deleted += 1
                elif res is L1Result.KEY_IS_LOCKED:
                    skipped += 1
        if tier in (None, Tier.L2):
            for l2 in self.tiers:
                if backend and backend not in (l2.backend, l2.name):
                    continue
                d, s = self._delete_l2(l2, keys, force)
                deleted += d
                skipped += s
        return deleted, skipped

    def _delete_l2(self, tier: L2Tier, keys: Sequence[ObjectKey], force: bool) -> tuple[int, int]:
        if not tier.available():
            return 0, len(keys)
        claimed = self.pins.claim_for_delete(tier.name, keys)
        targets = list(keys) if force else claimed
        try:
            return tier.delete_many(targets), len(keys) - len(targets)
        except L2Unavailable:
            return 0, len(keys)
        finally:
            self.pins.release_delete(tier.name, claimed)

    def clear(self, *, force: bool = False, timeout_s: float | None = None) -> tuple[int, int]:
        """Delete everything in L1, never a write-through still owed; ``(deleted, skipped)``.

        L2 is left alone (as in LMCache), and so is every chunk a store
        reported stored: an object whose write-through to L2 is queued or
        running is kept until the write-through queue has handled it (in
        order, up to ``timeout_s``, default ``clear_drain_timeout_s``), then
        deleted too. Objects stored while this runs may stay. Blocks: call it
        off the event loop. Raises Unavailable when the owed writes did not
        finish in time (everything else is cleared; those stay in L1).
        """
        timeout = self.options.clear_drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        owed = self.store.owed_keys
        deleted, skipped, kept = self.l1.clear_keeping(None, owed, force=force)
        while kept:
            if not self.store.drain(max(0.0, deadline - time.monotonic())):
                raise Unavailable(
                    f"{len(kept)} chunks still wait for their L2 write-through after "
                    f"{timeout:.0f} s; they stay in L1 (everything else was cleared), retry",
                    reason="L2_WRITE_THROUGH_BEHIND",
                    metadata={"waiting_chunks": str(len(kept))},
                )
            d, k, kept = self.l1.clear_keeping(kept, owed, force=force)
            deleted += d
            skipped += k
        return deleted, skipped

    # -- quotas ---------------------------------------------------------------

    def set_quota(
        self, cache_salt: str, *, l1_bytes: int | None = None, l2_bytes: int | None = None
    ) -> Quota:
        """Set a salt's byte limits (None = unlimited on that tier); applied at once."""
        quota = Quota(l1_bytes=l1_bytes, l2_bytes=l2_bytes)
        self.quotas.set_quota(cache_salt, quota)
        return quota

    def get_quota(self, cache_salt: str) -> Quota | None:
        """A salt's own quota, or None (then the default applies; None default = exempt)."""
        return self.quotas.get_quota(cache_salt)

    def delete_quota(self, cache_salt: str) -> bool:
        """Remove a salt's quota; False when it had none."""
        return self.quotas.delete_quota(cache_salt)

    def list_quotas(self) -> dict[str, Quota]:
        """Every explicit quota."""
        return self.quotas.list_quotas()

    # -- status -----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Everything an operator needs, as plain data."""
        pool = self.pool.stats()
        l1 = self.l1.stats()
        capacity = pool["capacity_bytes"]
        return {
            "instance_id": self.instance_id,
            "l1": {
                **pool,
                **l1,
                "usage_ratio": pool["used_bytes"] / capacity if capacity else 0.0,
                "read_ttl_s": self.l1.read_ttl_s,
                "write_ttl_s": self.l1.write_ttl_s,
                "growth_waits": self.growth_waits,
                "growth_wait_max_s": self.growth_wait_max_s,
                "loop_growths_deferred": self.loop_growths_deferred,
            },
            "l2": [tier.stats() for tier in self.tiers],
            "l2_index_complete": self._indexer.wait(0),
            "store": self.store.stats(),
            "prefetch": self.prefetch.stats(),
            "eviction": self.eviction.stats(),
            "quotas": {
                salt: {"l1_bytes": q.l1_bytes, "l2_bytes": q.l2_bytes}
                for salt, q in self.quotas.list_quotas().items()
            },
            "default_quota": (
                None
                if self.quotas.default is None
                else {
                    "l1_bytes": self.quotas.default.l1_bytes,
                    "l2_bytes": self.quotas.default.l2_bytes,
                }
            ),
        }

    def index_report(self) -> dict[str, dict[str, Any]]:
        """Per adapter: indexing state, object count and bytes (what it held at start and since)."""
        return {
            t.name: {
                "backend": t.backend,
                "shared": t.shared,
                "state": t.index_state,
                "objects": len(t.index),
                "bytes": t.index.total_bytes,
                "bytes_by_salt": t.index.bytes_by_salt(),
            }
            for t in self.tiers
        }

    def wait_l2_index(self, timeout: float) -> bool:
        """Wait until every adapter has been indexed at start (or failed to be)."""
        return self._indexer.wait(timeout)

    def publish_capacity(self) -> None:
        """Declare L1 and L2 capacities to the event sink (again after a re-registration)."""
        if self._sink is None:
            return
        modules = [CapacityModule(Tier.L1, L1_BACKEND, self.pool.capacity_bytes, False)]
        modules += [
            CapacityModule(Tier.L2, t.backend, t.declared_capacity_bytes, t.shared)
            for t in self.tiers
        ]
        try:
            self._sink.record_capacity(modules)
        except Exception:
            logger.exception("event sink rejected the capacity declaration")

    # -- maintenance (also used by tests) -------------------------------------------

    def run_eviction_once(self) -> int:
        """One L1 and one L2 eviction cycle now; returns keys evicted."""
        return self.eviction.evict_l1_once() + self.eviction.evict_l2_once()

    def flush_l2_writes(self, timeout: float) -> bool:
        """Wait until queued write-through to L2 is done; False on timeout."""
        return self.store.flush(timeout)

    def close(self) -> None:
        """Stop every thread, close adapters, remove the shared-memory segments. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.prefetch.close()
        if not self.store.flush(self.options.close_flush_timeout_s):
            logger.warning("L2 write-through not finished at close; remaining keys are dropped")
        self.store.close()
        self.eviction.close()
        self._indexer.close(self.options.close_flush_timeout_s)
        for tier in self.tiers:
            tier.close()
        self.pool.close()

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("the storage node is shutting down")

    async def make_room(self, sizes: Sequence[int]) -> None:
        """Before reserving ``sizes`` on an event loop: grow L1 off the loop if they need it.

        A growth maps and populates a new segment (tens of ms); done on the
        loop it would stall every RPC the loop serves, lookups included. The
        reservation that follows then finds the room, or evicts.
        """
        if any(not 0 < size <= self.pool.segment_bytes for size in sizes):
            return  # the reservation refuses these sizes itself
        self.pool.expect_reservation(sizes)
        if self.pool.would_fit(sizes) or not self.pool.can_grow():
            return
        started = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, self.pool.grow_for, sizes)
        waited = time.monotonic() - started
        self.growth_waits += 1
        self.growth_wait_max_s = max(self.growth_wait_max_s, waited)

    def _reclaim(self, sizes: Sequence[int]) -> None:
        """Allocation failed: grow the pool if it may, else evict until the sizes fit.

        On an event loop thread it never grows (see :meth:`make_room`): it asks
        the background grower for a segment and leaves these sizes out of
        memory rather than stall the loop or evict what the growth will make
        room for.
        """
        if _on_event_loop():
            if self.pool.can_grow():
                self.pool.request_growth()
                self.loop_growths_deferred += 1
                return
        elif self.pool.grow_for(sizes):
            return
        if not self.eviction.reclaim(sizes):
            logger.debug("L1 reclaim could not make room for %d objects", len(sizes))


def _on_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop right now."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
