"""The L1 object state machine: staging and resident objects with TTL read/write locks.

:class:`L1Manager` is the :class:`~.table.L1Table` (the maps, byte counts
and the steps that keep them in step) plus its public operations. Every
public method takes the one table lock and is atomic over its key list; each
returns one :class:`~.results.L1Result` per key ("omit, don't fail": a
duplicate or out-of-memory key is reported, never raised).

Read locks expire after 300 s and write reservations after 600 s by default.
Beyond LMCache:

- :meth:`L1Manager.reap` (run by the eviction loop) frees expired staging,
  temporary objects nobody holds any more, and doomed objects, instead of
  waiting for a later write of the same key to stumble on them.
- A forced delete of an object that is still read-locked or being written
  removes it from the index at once but keeps its memory until the lock is
  released or expires: a reader in the middle of a copy never reads memory
  that was handed to another object.
- When an allocation fails, the manager releases its lock, asks the
  ``reclaim`` hook (grow the pool, then evict) to make room and retries the
  failed keys once, so a store is not refused while evictable memory exists.

Listeners see every admission, removal and access, in the order they happen
(they are called under the manager lock, so they must be quick and must
never call back into the manager).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1.objects import L1Object
from kvmesh.storage.core.l1.pool import L1Pool
from kvmesh.storage.core.l1.results import L1Listener, L1Result, RemovalReason
from kvmesh.storage.core.l1.table import Entry, L1Table

logger = logging.getLogger(__name__)

DEFAULT_READ_TTL_S = 300.0
DEFAULT_WRITE_TTL_S = 600.0
MAX_READ_LOCKS_PER_CALL = 128
#: Writer tag used for stores that come from clients (all clients share it, as in LMCache).
STORE_TAG = "storage_manager"

ReclaimHook = Callable[[Sequence[int]], object]


class L1Manager(L1Table):
    """Owns every L1 object's state; the single source of truth for what L1 holds."""

    def __init__(
        self,
        pool: L1Pool,
        *,
        read_ttl_s: float = DEFAULT_READ_TTL_S,
        write_ttl_s: float = DEFAULT_WRITE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        reclaim: ReclaimHook | None = None,
    ) -> None:
        super().__init__(pool, read_ttl_s=read_ttl_s, write_ttl_s=write_ttl_s, clock=clock)
        self._reclaim = reclaim

    # -- wiring -----------------------------------------------------------

    def add_listener(self, listener: L1Listener) -> None:
        """Register an observer; listeners are called in registration order."""
        with self._lock:
            self._listeners.append(listener)

    def set_reclaim(self, reclaim: ReclaimHook | None) -> None:
        """Hook called (outside the lock) with the sizes that did not fit, before one retry."""
        self._reclaim = reclaim

    # -- writes -----------------------------------------------------------

    def reserve_write(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int],
        *,
        tag: str = STORE_TAG,
        temporary: bool = False,
        from_l2: bool = False,
    ) -> tuple[list[L1Result], dict[ObjectKey, L1Object]]:
        """Stage a new object per key for the writer ``tag``.

        Per key: resident → KEY_NOT_WRITABLE; staged by the same tag with a
        live write lock → KEY_NOT_WRITABLE; staged by the same tag with an
        expired lock → the buffer is handed to this writer (when the size
        matches); otherwise a new object is allocated, or OUT_OF_MEMORY after
        one reclaim-and-retry. Returns the results and the objects reserved.
        """
        if len(keys) != len(sizes):
            raise ValueError("keys and sizes must have the same length")
        limit = self.pool.max_object_bytes
        for size in sizes:
            if not 0 < size <= limit:
                raise InvalidArgument(
                    f"L1 object size {size} must be in [1, {limit}] (the L1 segment size)",
                    field="nbytes",
                )
        results: list[L1Result] = [L1Result.SUCCESS] * len(keys)
        objects: dict[ObjectKey, L1Object] = {}
        failed: list[int] = []
        with self._lock:
            now = self._clock()
            for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                results[i] = self._reserve_one(
                    key,
                    size,
                    tag=tag,
                    temporary=temporary,
                    from_l2=from_l2,
                    now=now,
                    objects=objects,
                )
                if results[i] is L1Result.OUT_OF_MEMORY:
                    failed.append(i)
        if failed and self._reclaim is not None:
            self.reclaim_calls += 1
            try:
                self._reclaim([sizes[i] for i in failed])
            except Exception:
                logger.exception("L1 reclaim hook failed; reporting OUT_OF_MEMORY")
            with self._lock:
                now = self._clock()
                for i in failed:
                    results[i] = self._reserve_one(
                        keys[i],
                        sizes[i],
                        tag=tag,
                        temporary=temporary,
                        from_l2=from_l2,
                        now=now,
                        objects=objects,
                    )
        oom = sum(1 for r in results if r is L1Result.OUT_OF_MEMORY)
        if oom:
            self.oom_keys += oom
            logger.debug("L1 reserve_write: %d of %d keys out of memory", oom, len(keys))
        return results, objects

    def finish_write(self, keys: Sequence[ObjectKey], *, tag: str = STORE_TAG) -> list[L1Result]:
        """Publish staged objects (staging → resident); a key already resident keeps its copy."""
        with self._lock:
            return self._finish(keys, tag, read_locks=0)

    def finish_write_and_reserve_read(
        self, keys: Sequence[ObjectKey], n: int, *, tag: str = STORE_TAG
    ) -> list[L1Result]:
        """Publish staged objects and take ``n`` read locks on each, atomically."""
        with self._lock:
            return self._finish(keys, tag, read_locks=_clamp_readers(n))

    def finish_write_and_delete(
        self, keys: Sequence[ObjectKey], *, tag: str = STORE_TAG
    ) -> list[L1Result]:
        """Discard staged objects (a failed transfer or load)."""
        results: list[L1Result] = []
        with self._lock:
            for key in keys:
                entry = self._pop_staging(key, tag)
                if entry is None:
                    results.append(
                        L1Result.SUCCESS
                        if self._free_doomed_writer(key, tag)
                        else L1Result.KEY_NOT_EXIST
                    )
                    continue
                self._free(entry)
                results.append(L1Result.SUCCESS)
        return results

    # -- reads ------------------------------------------------------------

    def reserve_read(self, keys: Sequence[ObjectKey], n: int = 1) -> list[L1Result]:
        """Take ``n`` (clamped to 1..128) read locks on each resident key."""
        n = _clamp_readers(n)
        results: list[L1Result] = []
        with self._lock:
            now = self._clock()
            for key in keys:
                entry = self._resident.get(key)
                if entry is None:
                    results.append(L1Result.KEY_NOT_EXIST)
                    continue
                entry.read.lock(n, now, self.read_ttl_s)
                results.append(L1Result.SUCCESS)
        return results

    def unsafe_read(
        self, keys: Sequence[ObjectKey]
    ) -> tuple[list[L1Result], dict[ObjectKey, L1Object]]:
        """Objects of keys the caller has already read-locked; takes no lock of its own."""
        results: list[L1Result] = []
        objects: dict[ObjectKey, L1Object] = {}
        with self._lock:
            now = self._clock()
            for key in keys:
                entry = self._resident.get(key)
                if entry is None:
                    results.append(L1Result.KEY_NOT_EXIST)
                elif not entry.read.is_locked(now):
                    results.append(L1Result.KEY_NOT_READABLE)
                else:
                    objects[key] = entry.obj
                    results.append(L1Result.SUCCESS)
        return results, objects

    def finish_read(self, keys: Sequence[ObjectKey], n: int = 1) -> list[L1Result]:
        """Release ``n`` read locks per key; a temporary object is freed with its last lock."""
        n = _clamp_readers(n)
        results: list[L1Result] = []
        released: list[Entry] = []
        with self._lock:
            now = self._clock()
            for key in keys:
                entry = self._resident.get(key)
                if entry is None:
                    results.append(
                        L1Result.SUCCESS
                        if self._release_doomed_reader(key, n, now)
                        else L1Result.KEY_NOT_EXIST
                    )
                    continue
                if not entry.read.is_locked(now):
                    # Expired or never locked. A temporary object in that state
                    # has no holder left, so it is garbage either way.
                    if entry.temporary:
                        released.append(self._remove_resident(key))
                    results.append(L1Result.KEY_IN_WRONG_STATE)
                    continue
                entry.read.unlock(n)
                if entry.temporary and not entry.read.is_locked(now):
                    released.append(self._remove_resident(key))
                results.append(L1Result.SUCCESS)
            self._notify_removed(released, RemovalReason.RELEASED)
            for entry in released:
                self._free(entry)
        return results

    def touch(self, keys: Sequence[ObjectKey]) -> int:
        """Mark resident keys as used (LRU recency, ACCESS events); returns how many were."""
        with self._lock:
            hits = [k for k in keys if k in self._resident]
            if hits:
                for listener in self._listeners:
                    listener.on_touched(hits)
        return len(hits)

    def contains(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Per-key residency (staging objects do not count)."""
        with self._lock:
            return [k in self._resident for k in keys]

    def size_of(self, key: ObjectKey) -> int | None:
        """Size of a resident object, or None."""
        with self._lock:
            entry = self._resident.get(key)
            return None if entry is None else entry.obj.size

    # -- removal ----------------------------------------------------------

    def delete(
        self,
        keys: Sequence[ObjectKey],
        *,
        force: bool = False,
        reason: RemovalReason = RemovalReason.DELETED,
    ) -> list[L1Result]:
        """Remove keys from L1.

        Without ``force`` a read-locked object or a key with live staging is
        refused with KEY_IS_LOCKED (expired staging is reclaimed either way).
        With ``force`` the key disappears at once; memory still in use by a
        lock holder is freed when that lock is released or expires.
        """
        results: list[L1Result] = []
        with self._lock:
            now = self._clock()
            removed: list[Entry] = []
            for key in keys:
                results.append(self._delete_one(key, force, now, removed))
            self._notify_removed(removed, reason)
            self._dispose(removed, now)
        return results

    def evict(self, keys: Sequence[ObjectKey]) -> tuple[list[ObjectKey], int]:
        """Remove the keys that are evictable right now; returns them and the bytes freed."""
        with self._lock:
            now = self._clock()
            removed = [
                self._remove_resident(k)
                for k in keys
                if (e := self._resident.get(k)) is not None and not e.read.is_locked(now)
            ]
            self._notify_removed(removed, RemovalReason.EVICTED)
            freed = 0
            for entry in removed:
                freed += entry.obj.capacity
                self._free(entry)
        return [e.key for e in removed], freed

    def clear(self, *, force: bool = False) -> tuple[int, int]:
        """Delete every key; returns ``(deleted, skipped)`` counted in keys."""
        with self._lock:
            keys = list(self._resident.keys() | self._staging.keys())
        results = self.delete(keys, force=force, reason=RemovalReason.CLEARED)
        deleted = sum(1 for r in results if r is L1Result.SUCCESS)
        skipped = sum(1 for r in results if r is L1Result.KEY_IS_LOCKED)
        return deleted, skipped

    def clear_keeping(
        self,
        keys: Sequence[ObjectKey] | None,
        keep: Callable[[], Iterable[ObjectKey]],
        *,
        force: bool = False,
    ) -> tuple[int, int, list[ObjectKey]]:
        """Clear ``keys`` (None: every key now in L1) except those ``keep()`` names.

        ``keep`` is called once, under the manager lock, so no key can join
        it before the deletes are done (e.g. the keys whose L2 write-through
        is still owed). Returns ``(deleted, skipped, kept)``, counted in keys.
        """
        with self._lock:
            if keys is None:
                keys = list(self._resident.keys() | self._staging.keys())
            held = set(keep())
            now = self._clock()
            removed: list[Entry] = []
            deleted = skipped = 0
            kept: list[ObjectKey] = []
            for key in keys:
                if key in held:
                    kept.append(key)
                    continue
                result = self._delete_one(key, force, now, removed)
                if result is L1Result.SUCCESS:
                    deleted += 1
                elif result is L1Result.KEY_IS_LOCKED:
                    skipped += 1
            self._notify_removed(removed, RemovalReason.CLEARED)
            self._dispose(removed, now)
        return deleted, skipped, kept

    def is_key_evictable(self, key: ObjectKey) -> bool:
        """Resident and not read-locked (staging is never evictable)."""
        with self._lock:
            entry = self._resident.get(key)
            return entry is not None and not entry.read.is_locked(self._clock())

    def reap(self) -> int:
        """Free expired staging, lock-less temporary objects and released doomed memory.

        Returns the number of objects freed. Run periodically by the eviction loop.
        """
        with self._lock:
            now = self._clock()
            freed = 0
            for key in list(self._staging):
                tags = self._staging[key]
                for tag in [t for t, e in tags.items() if not e.write.is_locked(now)]:
                    entry = tags.pop(tag)
                    self._staging_bytes -= entry.obj.size
                    self._free(entry)
                    self.reaped_staging += 1
                    freed += 1
                if not tags:
                    del self._staging[key]
            stale = [k for k in self._temporary if not self._resident[k].read.is_locked(now)]
            removed = [self._remove_resident(k) for k in stale]
            self._notify_removed(removed, RemovalReason.EXPIRED)
            for entry in removed:
                self._free(entry)
            self.reaped_temporary += len(removed)
            freed += len(removed)
            for key in list(self._doomed):
                entries = self._doomed[key]
                keep = [e for e in entries if e.read.is_locked(now) or e.write.is_locked(now)]
                for entry in entries:
                    if entry not in keep:
                        self._free(entry)
                        self.freed_doomed += 1
                        freed += 1
                if keep:
                    self._doomed[key] = keep
                else:
                    del self._doomed[key]
        if freed:
            logger.debug("L1 reap freed %d objects", freed)
        return freed


def _clamp_readers(n: int) -> int:
    return min(max(n, 1), MAX_READ_LOCKS_PER_CALL)
