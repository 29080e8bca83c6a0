"""The L1 object state machine: staging and resident objects with TTL read/write locks.

Two maps, as in LMCache (reference mp_server §10.2): **resident** ``key →
entry`` (visible to readers) and **staging** ``key → {writer tag → entry}``
(being written, invisible). Every public method takes the one manager lock
and is atomic over its key list; each returns one :class:`L1Result` per key
("omit, don't fail": a duplicate or out-of-memory key is reported, never
raised).

Locks are :class:`TTLLock` counters with a deadline, so a client that dies
holding one cannot pin memory forever: read locks expire after 300 s and
write reservations after 600 s by default. Beyond LMCache:

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

This module stays whole (about 700 lines): each public method is one atomic
transition over the same maps and byte counts under one lock, and the
private helpers are those transitions' steps, so splitting the table from the
state machine would spread one invariant (each object sits in exactly one of
the resident, staging and doomed maps until the pool gets its memory back,
with the byte counts in step) over two modules.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1.objects import L1Object
from kvmesh.storage.core.l1.pool import L1Pool

logger = logging.getLogger(__name__)

DEFAULT_READ_TTL_S = 300.0
DEFAULT_WRITE_TTL_S = 600.0
MAX_READ_LOCKS_PER_CALL = 128
#: Writer tag used for stores that come from clients (all clients share it, as in LMCache).
STORE_TAG = "storage_manager"


class L1Result(enum.Enum):
    """Per-key outcome of an L1 operation."""

    SUCCESS = "success"
    KEY_NOT_EXIST = "key_not_exist"
    KEY_NOT_READABLE = "key_not_readable"
    KEY_NOT_WRITABLE = "key_not_writable"
    KEY_IN_WRONG_STATE = "key_in_wrong_state"
    KEY_IS_LOCKED = "key_is_locked"
    OUT_OF_MEMORY = "out_of_memory"


class RemovalReason(enum.Enum):
    """Why a resident object left L1."""

    DELETED = "deleted"  # an explicit delete (operator, coordinator)
    EVICTED = "evicted"  # watermark, quota or allocation-failure eviction
    CLEARED = "cleared"  # clear()
    RELEASED = "released"  # temporary object, last read lock released
    EXPIRED = "expired"  # temporary object whose read locks timed out
    WRITTEN_THROUGH = "written_through"  # skip_l1 store policy after a successful L2 store


class L1Listener(Protocol):
    """Observer of placement changes in L1 (store controller, eviction policy, events)."""

    def on_admitted(self, keys: Sequence[ObjectKey], sizes: Sequence[int], from_l2: bool) -> None:
        """Keys became resident. ``from_l2``: loaded by a prefetch, not written by a client."""
        ...

    def on_removed(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], reason: RemovalReason
    ) -> None:
        """Resident keys left L1."""
        ...

    def on_touched(self, keys: Sequence[ObjectKey]) -> None:
        """Resident keys were used (LRU recency)."""
        ...


class TTLLock:
    """A counter with a deadline: locked while count > 0 and the deadline has not passed.

    Every ``lock`` pushes the deadline to ``now + ttl``; locking an expired
    lock restarts the count, so locks leaked by a crashed client vanish.
    """

    __slots__ = ("count", "deadline")

    def __init__(self) -> None:
        self.count = 0
        self.deadline = 0.0

    def lock(self, n: int, now: float, ttl: float) -> None:
        """Add ``n`` holders and refresh the deadline."""
        if self.count > 0 and now >= self.deadline:
            self.count = 0
        self.count += n
        self.deadline = now + ttl

    def unlock(self, n: int) -> None:
        """Remove ``n`` holders (never below zero)."""
        self.count = max(0, self.count - n)

    def is_locked(self, now: float) -> bool:
        """Held by anyone whose lock has not expired."""
        return self.count > 0 and now < self.deadline


@dataclass(slots=True, eq=False)
class _Entry:
    key: ObjectKey
    obj: L1Object
    temporary: bool
    from_l2: bool
    tag: str | None  # writer tag while staging; None once resident
    write: TTLLock
    read: TTLLock


ReclaimHook = Callable[[Sequence[int]], object]


class L1Manager:
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
        if read_ttl_s <= 0 or write_ttl_s <= 0:
            raise ValueError("lock TTLs must be > 0 seconds")
        self.pool = pool
        self.read_ttl_s = read_ttl_s
        self.write_ttl_s = write_ttl_s
        self._clock = clock
        self._reclaim = reclaim
        self._lock = threading.Lock()
        self._resident: dict[ObjectKey, _Entry] = {}
        self._staging: dict[ObjectKey, dict[str, _Entry]] = {}
        # Removed from the index but memory kept until their locks go (forced deletes).
        self._doomed: dict[ObjectKey, list[_Entry]] = {}
        self._temporary: set[ObjectKey] = set()
        self._listeners: list[L1Listener] = []
        self._resident_bytes = 0
        self._staging_bytes = 0
        self._bytes_by_salt: dict[str, int] = {}
        # Counters (plain ints; read by stats()).
        self.oom_keys = 0
        self.reclaim_calls = 0
        self.reaped_staging = 0
        self.reaped_temporary = 0
        self.freed_doomed = 0

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
        released: list[_Entry] = []
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
            removed: list[_Entry] = []
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
            removed: list[_Entry] = []
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

    # -- introspection ----------------------------------------------------

    @property
    def resident_count(self) -> int:
        """Objects visible to readers."""
        with self._lock:
            return len(self._resident)

    @property
    def staging_count(self) -> int:
        """Objects being written (all writer tags)."""
        with self._lock:
            return sum(len(t) for t in self._staging.values())

    @property
    def resident_bytes(self) -> int:
        """Sum of resident object sizes (unaligned)."""
        with self._lock:
            return self._resident_bytes

    def bytes_by_salt(self) -> dict[str, int]:
        """Resident bytes per cache_salt ("" is the default tenant)."""
        with self._lock:
            return dict(self._bytes_by_salt)

    def resident_keys(self) -> list[ObjectKey]:
        """Snapshot of the resident keys."""
        with self._lock:
            return list(self._resident)

    def announce_resident(
        self, record: Callable[[list[tuple[ObjectKey, int]]], None], batch: int = 1024
    ) -> int:
        """Hand every resident ``(key, size)`` to ``record``, in batches, under the lock.

        Under the lock, so no admission or removal (whose listeners also run
        under it) can fall between the snapshot and the records: a resync's
        STOREs never follow the DELETE of a key they still name. ``record``
        must be quick and must not call back into the manager. Returns the
        number of keys.
        """
        with self._lock:
            entries = [(key, entry.obj.size) for key, entry in self._resident.items()]
            for start in range(0, len(entries), batch):
                record(entries[start : start + batch])
        return len(entries)

    def read_lock_count(self, key: ObjectKey) -> int:
        """Live read locks on a resident key (0 when expired or absent)."""
        with self._lock:
            entry = self._resident.get(key)
            if entry is None or not entry.read.is_locked(self._clock()):
                return 0
            return entry.read.count

    def stats(self) -> dict[str, Any]:
        """Object counts by state, bytes, and counters."""
        with self._lock:
            now = self._clock()
            locked = sum(1 for e in self._resident.values() if e.read.is_locked(now))
            return {
                "resident_objects": len(self._resident),
                "read_locked_objects": locked,
                "temporary_objects": len(self._temporary),
                "staging_objects": sum(len(t) for t in self._staging.values()),
                "doomed_objects": sum(len(v) for v in self._doomed.values()),
                "resident_bytes": self._resident_bytes,
                "staging_bytes": self._staging_bytes,
                "bytes_by_salt": dict(self._bytes_by_salt),
                "oom_keys": self.oom_keys,
                "reclaim_calls": self.reclaim_calls,
                "reaped_staging": self.reaped_staging,
                "reaped_temporary": self.reaped_temporary,
                "freed_doomed": self.freed_doomed,
            }

    # -- internals (all called with self._lock held) -----------------------

    def _reserve_one(
        self,
        key: ObjectKey,
        size: int,
        *,
        tag: str,
        temporary: bool,
        from_l2: bool,
        now: float,
        objects: dict[ObjectKey, L1Object],
    ) -> L1Result:
        if key in self._resident:
            return L1Result.KEY_NOT_WRITABLE
        tags = self._staging.get(key)
        old = tags.get(tag) if tags else None
        if old is not None:
            if old.write.is_locked(now):
                return L1Result.KEY_NOT_WRITABLE
            if old.obj.size == size:
                # The earlier writer of this tag died; its buffer serves the new one.
                old.write = TTLLock()
                old.write.lock(1, now, self.write_ttl_s)
                old.temporary = temporary
                old.from_l2 = from_l2
                objects[key] = old.obj
                return L1Result.SUCCESS
            self._pop_staging(key, tag)
            self._free(old)
        obj = self.pool.allocate(size)
        if obj is None:
            return L1Result.OUT_OF_MEMORY
        entry = _Entry(key, obj, temporary, from_l2, tag, TTLLock(), TTLLock())
        entry.write.lock(1, now, self.write_ttl_s)
        self._staging.setdefault(key, {})[tag] = entry
        self._staging_bytes += size
        objects[key] = obj
        return L1Result.SUCCESS

    def _finish(self, keys: Sequence[ObjectKey], tag: str, read_locks: int) -> list[L1Result]:
        now = self._clock()
        results: list[L1Result] = []
        admitted: list[_Entry] = []
        for key in keys:
            entry = self._pop_staging(key, tag)
            if entry is None:
                self._free_doomed_writer(key, tag)
                results.append(L1Result.KEY_NOT_EXIST)
                continue
            if not entry.write.is_locked(now):
                # The reservation expired: the writer was presumed dead, so the
                # bytes are not trusted. The caller is finishing now, so free it.
                self._free(entry)
                results.append(L1Result.KEY_IN_WRONG_STATE)
                continue
            current = self._resident.get(key)
            if current is not None:
                # Someone else published the same key first; content is identical.
                self._free(entry)
                if read_locks:
                    current.read.lock(read_locks, now, self.read_ttl_s)
                results.append(L1Result.SUCCESS)
                continue
            entry.tag = None
            entry.write = TTLLock()
            if read_locks:
                entry.read.lock(read_locks, now, self.read_ttl_s)
            self._resident[key] = entry
            self._resident_bytes += entry.obj.size
            salt = key.cache_salt
            self._bytes_by_salt[salt] = self._bytes_by_salt.get(salt, 0) + entry.obj.size
            if entry.temporary:
                self._temporary.add(key)
            admitted.append(entry)
            results.append(L1Result.SUCCESS)
        for from_l2 in (False, True):
            group = [e for e in admitted if e.from_l2 is from_l2]
            if group:
                keys_ = [e.key for e in group]
                sizes = [e.obj.size for e in group]
                for listener in self._listeners:
                    listener.on_admitted(keys_, sizes, from_l2)
        return results

    def _delete_one(
        self, key: ObjectKey, force: bool, now: float, removed: list[_Entry]
    ) -> L1Result:
        entry = self._resident.get(key)
        tags = self._staging.get(key, {})
        live = [t for t, e in tags.items() if e.write.is_locked(now)]
        expired = [t for t in tags if t not in live]
        for tag in expired:
            stale = self._pop_staging(key, tag)
            if stale is not None:
                self._free(stale)
        if entry is None and not live:
            return L1Result.SUCCESS if expired else L1Result.KEY_NOT_EXIST
        if not force and (live or (entry is not None and entry.read.is_locked(now))):
            return L1Result.KEY_IS_LOCKED
        if entry is not None:
            removed.append(self._remove_resident(key))
        for tag in live:
            staged = self._pop_staging(key, tag)
            if staged is not None:
                self._doomed.setdefault(key, []).append(staged)
        return L1Result.SUCCESS

    def _dispose(self, removed: Iterable[_Entry], now: float) -> None:
        """Free removed entries, or park them as doomed while someone still holds a lock."""
        for entry in removed:
            if entry.read.is_locked(now):
                self._doomed.setdefault(entry.key, []).append(entry)
            else:
                self._free(entry)

    def _remove_resident(self, key: ObjectKey) -> _Entry:
        entry = self._resident.pop(key)
        self._temporary.discard(key)
        size = entry.obj.size
        self._resident_bytes -= size
        salt = key.cache_salt
        left = self._bytes_by_salt.get(salt, 0) - size
        if left > 0:
            self._bytes_by_salt[salt] = left
        else:
            self._bytes_by_salt.pop(salt, None)
        return entry

    def _pop_staging(self, key: ObjectKey, tag: str) -> _Entry | None:
        tags = self._staging.get(key)
        if not tags:
            return None
        entry = tags.pop(tag, None)
        if not tags:
            del self._staging[key]
        if entry is not None:
            self._staging_bytes -= entry.obj.size
        return entry

    def _free_doomed_writer(self, key: ObjectKey, tag: str) -> bool:
        """A writer finishing a staging entry that a forced delete doomed: free it now."""
        entries = self._doomed.get(key)
        if not entries:
            return False
        for entry in entries:
            if entry.tag == tag:
                entries.remove(entry)
                if not entries:
                    del self._doomed[key]
                self._free(entry)
                self.freed_doomed += 1
                return True
        return False

    def _release_doomed_reader(self, key: ObjectKey, n: int, now: float) -> bool:
        """A reader releasing a lock on an object that a forced delete doomed."""
        entries = self._doomed.get(key)
        if not entries:
            return False
        for entry in entries:
            if entry.tag is None and entry.read.is_locked(now):
                entry.read.unlock(n)
                if not entry.read.is_locked(now):
                    entries.remove(entry)
                    if not entries:
                        del self._doomed[key]
                    self._free(entry)
                    self.freed_doomed += 1
                return True
        return False

    def _notify_removed(self, removed: Sequence[_Entry], reason: RemovalReason) -> None:
        if not removed:
            return
        keys = [e.key for e in removed]
        sizes = [e.obj.size for e in removed]
        for listener in self._listeners:
            listener.on_removed(keys, sizes, reason)

    def _free(self, entry: _Entry) -> None:
        self.pool.free(entry.obj)


def _clamp_readers(n: int) -> int:
    return min(max(n, 1), MAX_READ_LOCKS_PER_CALL)
