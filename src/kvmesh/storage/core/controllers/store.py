"""StoreController: asynchronous write-through of client-written L1 objects to every L2 adapter.

It listens to L1 admissions. Keys written by clients (not those loaded from
L2 by a prefetch: they are in L2 already) are queued and written in batches
by one dispatcher thread, which read-locks each batch in L1 for the
duration of the L2 writes (so eviction cannot free the bytes under the
adapter) and runs the adapters in parallel on an I/O pool. A degraded
adapter is skipped, never waited on; there is no retry (as in LMCache: the
object stays in L1 and the next store of the key writes it again).

Policies (LMCache 0.5.6's): ``default`` keeps the object in L1;
``skip_l1`` deletes it from L1 once at least one adapter stored it (L1 as a
pure write buffer).

A Clear must not drop an object whose write-through is still owed (the
store reported it stored, and Clear leaves L2 alone): :meth:`owed_keys`
says which keys are queued or being written right now, and :meth:`drain`
waits until everything queued before it has been handled.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvmesh.common.keys import ObjectKey
from kvmesh.common.thread_priority import lower_this_thread
from kvmesh.storage.core.controllers.l2tier import L2Tier
from kvmesh.storage.core.l1.manager import L1Manager
from kvmesh.storage.core.l1.results import L1Result, RemovalReason
from kvmesh.storage.core.l2.base import L2Unavailable

logger = logging.getLogger(__name__)

DEFAULT_BATCH_KEYS = 32
DEFAULT_BATCH_BYTES = 256 << 20
DEFAULT_MAX_PENDING_KEYS = 65536


class StorePolicy(enum.Enum):
    """What happens to the L1 copy after a successful L2 store."""

    DEFAULT = "default"
    SKIP_L1 = "skip_l1"


class StoreController:
    """Writes client-written L1 admissions through to the L2 adapters.

    Threads: one dispatcher (``kvmesh-l2-store``) and an I/O pool with one
    worker per adapter (``kvmesh-l2-put``). ``close()`` stops both; pending
    keys that were not written are dropped (and counted).
    """

    def __init__(
        self,
        l1: L1Manager,
        tiers: Sequence[L2Tier],
        *,
        policy: StorePolicy = StorePolicy.DEFAULT,
        batch_max_keys: int = DEFAULT_BATCH_KEYS,
        batch_max_bytes: int = DEFAULT_BATCH_BYTES,
        max_pending_keys: int = DEFAULT_MAX_PENDING_KEYS,
    ) -> None:
        self.l1 = l1
        self.tiers = list(tiers)
        self.policy = policy
        self.batch_max_keys = max(1, batch_max_keys)
        self.batch_max_bytes = max(1, batch_max_bytes)
        self.max_pending_keys = max(1, max_pending_keys)
        self._cond = threading.Condition()
        self._pending: deque[tuple[ObjectKey, int]] = deque()
        self._busy = False
        self._writing: list[ObjectKey] = []  # the batch being written now
        # Keys ever queued, and keys handled (written, failed, skipped or dropped):
        # the queue is FIFO, so "handled >= queued at time t" means done up to t.
        self._enqueued = 0
        self._handled = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        # Both threads run at a lower CPU priority: nobody waits for a write-through.
        self._io = ThreadPoolExecutor(
            max_workers=max(1, len(self.tiers)),
            thread_name_prefix="kvmesh-l2-put",
            initializer=lower_this_thread,
        )
        # Counters.
        self.queued_keys = 0
        self.dropped_keys = 0
        self.stored_keys = 0
        self.failed_keys = 0
        self.missing_keys = 0  # left L1 before they could be written
        self.skipped_keys = 0  # no adapter available
        self.l1_deleted_keys = 0
        self.batches = 0
        self.errors = 0

    # -- L1Listener ---------------------------------------------------------

    def on_admitted(self, keys: Sequence[ObjectKey], sizes: Sequence[int], from_l2: bool) -> None:
        """Queue client-written keys (called under the L1 lock: only enqueue here)."""
        if from_l2 or not self.tiers:
            return
        with self._cond:
            if self._closing:
                return
            self._pending.extend(zip(keys, sizes, strict=True))
            self.queued_keys += len(keys)
            self._enqueued += len(keys)
            overflow = len(self._pending) - self.max_pending_keys
            if overflow > 0:
                # L2 cannot keep up: drop the oldest (still in L1; a later store rewrites them).
                for _ in range(overflow):
                    self._pending.popleft()
                self.dropped_keys += overflow
                self._handled += overflow
                logger.warning("L2 write-through queue full; dropped %d oldest keys", overflow)
            self._cond.notify_all()

    def on_removed(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], reason: RemovalReason
    ) -> None:
        """Nothing to do: a key that left L1 is skipped when its batch is read-locked."""

    def on_touched(self, keys: Sequence[ObjectKey]) -> None:
        """Nothing to do."""

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start the dispatcher thread (no-op without adapters)."""
        if self._thread is not None or not self.tiers:
            return
        self._thread = threading.Thread(target=self._run, name="kvmesh-l2-store", daemon=True)
        self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued key has been handled; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cond.wait(left)
        return True

    def drain(self, timeout: float) -> bool:
        """Wait until every key queued before this call has been handled; False on timeout.

        Keys queued meanwhile are not waited for (a steady stream of stores
        cannot hold a caller forever).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._enqueued
            while self._handled < target:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cond.wait(left)
        return True

    def owed_keys(self) -> set[ObjectKey]:
        """Keys whose write-through is queued or running right now."""
        with self._cond:
            return {k for k, _ in self._pending} | set(self._writing)

    def close(self) -> None:
        """Stop the dispatcher after its current batch and shut the I/O pool down."""
        with self._cond:
            self._closing = True
            dropped = len(self._pending)
            self._pending.clear()
            self._handled += dropped
            self._cond.notify_all()
        if dropped:
            self.dropped_keys += dropped
            logger.info("store controller closing; %d queued keys not written to L2", dropped)
        if self._thread is not None:
            self._thread.join()
        self._io.shutdown(wait=True)

    def stats(self) -> dict[str, Any]:
        """Queue depth and counters."""
        with self._cond:
            pending = len(self._pending)
            busy = self._busy
        return {
            "policy": self.policy.value,
            "pending_keys": pending,
            "busy": busy,
            "queued_keys": self.queued_keys,
            "dropped_keys": self.dropped_keys,
            "stored_keys": self.stored_keys,
            "failed_keys": self.failed_keys,
            "missing_keys": self.missing_keys,
            "skipped_keys": self.skipped_keys,
            "l1_deleted_keys": self.l1_deleted_keys,
            "batches": self.batches,
            "errors": self.errors,
        }

    # -- dispatcher ---------------------------------------------------------

    def _run(self) -> None:
        lower_this_thread()
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                batch = self._take_batch_locked()
                self._busy = True
                self._writing = batch
            try:
                self._store_batch(batch)
            except Exception:
                self.errors += 1
                logger.exception("L2 write-through of %d keys failed", len(batch))
            finally:
                with self._cond:
                    self._busy = False
                    self._writing = []
                    self._handled += len(batch)
                    self._cond.notify_all()

    def _drop_written(self, tier: L2Tier, keys: list[ObjectKey]) -> None:
        logger.error(
            "L2 write-through to %s outlasted its L1 lock (%.0f s): deleting the %d objects "
            "it wrote, whose memory may have been reused meanwhile",
            tier.name,
            self.l1.read_ttl_s,
            len(keys),
        )
        try:
            tier.delete_many(keys)
        except Exception:
            logger.exception("deleting the objects of a lapsed write-through failed")

    def _take_batch_locked(self) -> list[ObjectKey]:
        batch: list[ObjectKey] = []
        nbytes = 0
        while self._pending and len(batch) < self.batch_max_keys:
            key, size = self._pending[0]
            if batch and nbytes + size > self.batch_max_bytes:
                break
            self._pending.popleft()
            batch.append(key)
            nbytes += size
        return batch

    def _store_batch(self, keys: list[ObjectKey]) -> None:
        self.batches += 1
        tiers = [t for t in self.tiers if t.available()]
        if not tiers:
            self.skipped_keys += len(keys)
            return
        locked_at = self.l1.clock()
        results = self.l1.reserve_read(keys, 1)
        locked = [k for k, r in zip(keys, results, strict=True) if r is L1Result.SUCCESS]
        self.missing_keys += len(keys) - len(locked)
        if not locked:
            return
        stored: set[ObjectKey] = set()
        lapsed = False
        try:
            _, objects = self.l1.unsafe_read(locked)
            items = [(k, objects[k].view()) for k in locked if k in objects]
            futures: list[tuple[L2Tier, Future[list[bool]]]] = [
                (tier, self._io.submit(tier.put_many, items)) for tier in tiers
            ]
            for tier, future in futures:
                # No timeout here on purpose: the adapter bounds its own calls,
                # and the L1 lock must outlive any read of the buffers.
                try:
                    ok = future.result()
                except L2Unavailable:
                    self.failed_keys += len(items)
                    continue
                if self.l1.lapsed(locked_at):
                    # The L1 lock lapsed while the adapter wrote (a stalled disk, say):
                    # eviction may have given the buffers to other objects meanwhile, so
                    # what was written may be another chunk's bytes under these keys.
                    lapsed = True
                    written = [k for (k, _), good in zip(items, ok, strict=True) if good]
                    self._drop_written(tier, written)
                    self.failed_keys += len(items)
                    continue
                for (key, _), good in zip(items, ok, strict=True):
                    if good:
                        stored.add(key)
                    else:
                        self.failed_keys += 1
                logger.debug("wrote %d of %d keys to L2 %s", sum(ok), len(items), tier.name)
            self.stored_keys += len(stored)
        finally:
            if not lapsed:  # a lapsed lock is no longer ours: releasing it would take others'
                self.l1.finish_read(locked, 1)
        if self.policy is StorePolicy.SKIP_L1 and stored:
            done = [k for k in locked if k in stored]
            deleted = self.l1.delete(done, reason=RemovalReason.WRITTEN_THROUGH)
            self.l1_deleted_keys += sum(1 for r in deleted if r is L1Result.SUCCESS)
