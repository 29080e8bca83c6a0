"""The L1 object table: the resident, staging and doomed maps and the steps that move entries.

Two maps, as in LMCache 0.5.6: **resident** ``key →
entry`` (visible to readers) and **staging** ``key → {writer tag → entry}``
(being written, invisible); beyond LMCache, a third, **doomed**, holds what a
forced delete took out of the index while a lock holder still uses its
memory. The invariant lives here and only here: each object sits in exactly
one of the three maps until the pool gets its memory back, with the byte
counts in step. Every change to the maps goes through the private steps of
:class:`L1Table`, all called with ``_lock`` held; :class:`~.manager.L1Manager`
composes them into its atomic public operations.

Locks are :class:`TTLLock` counters with a deadline, so a client that dies
holding one cannot pin memory forever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1.objects import L1Object
from kvmesh.storage.core.l1.pool import L1Pool
from kvmesh.storage.core.l1.results import L1Listener, L1Result, RemovalReason


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
class Entry:
    """One L1 object and its locks, in whichever map holds it."""

    key: ObjectKey
    obj: L1Object
    temporary: bool
    from_l2: bool
    tag: str | None  # writer tag while staging; None once resident
    write: TTLLock
    read: TTLLock


class L1Table:
    """The maps, byte counts and counters of L1, with read-only views and the lock-held steps."""

    def __init__(
        self,
        pool: L1Pool,
        *,
        read_ttl_s: float,
        write_ttl_s: float,
        clock: Callable[[], float],
    ) -> None:
        if read_ttl_s <= 0 or write_ttl_s <= 0:
            raise ValueError("lock TTLs must be > 0 seconds")
        self.pool = pool
        self.read_ttl_s = read_ttl_s
        self.write_ttl_s = write_ttl_s
        #: The clock the locks' deadlines are on (a holder checks its lock against it).
        self.clock = clock
        self._clock = clock
        self._lock = threading.Lock()
        self._resident: dict[ObjectKey, Entry] = {}
        self._staging: dict[ObjectKey, dict[str, Entry]] = {}
        # Removed from the index but memory kept until their locks go (forced deletes).
        self._doomed: dict[ObjectKey, list[Entry]] = {}
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

    def lapsed(self, locked_at: float | None) -> bool:
        """True when read locks taken at ``locked_at`` (on :attr:`clock`) may have lapsed.

        Their holder must then drop them rather than release them: once a lock
        lapses, the next reader's lock restarts its count, so a late release
        would take that reader's lock and let eviction reuse memory it is
        copying. ``None`` (the time is not known) never counts as lapsed.
        """
        return locked_at is not None and self._clock() - locked_at >= self.read_ttl_s

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
        entry = Entry(key, obj, temporary, from_l2, tag, TTLLock(), TTLLock())
        entry.write.lock(1, now, self.write_ttl_s)
        self._staging.setdefault(key, {})[tag] = entry
        self._staging_bytes += size
        objects[key] = obj
        return L1Result.SUCCESS

    def _finish(self, keys: Sequence[ObjectKey], tag: str, read_locks: int) -> list[L1Result]:
        now = self._clock()
        results: list[L1Result] = []
        admitted: list[Entry] = []
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
        self, key: ObjectKey, force: bool, now: float, removed: list[Entry]
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

    def _dispose(self, removed: Iterable[Entry], now: float) -> None:
        """Free removed entries, or park them as doomed while someone still holds a lock."""
        for entry in removed:
            if entry.read.is_locked(now):
                self._doomed.setdefault(entry.key, []).append(entry)
            else:
                self._free(entry)

    def _remove_resident(self, key: ObjectKey) -> Entry:
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

    def _pop_staging(self, key: ObjectKey, tag: str) -> Entry | None:
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

    def _notify_removed(self, removed: Sequence[Entry], reason: RemovalReason) -> None:
        if not removed:
            return
        keys = [e.key for e in removed]
        sizes = [e.obj.size for e in removed]
        for listener in self._listeners:
            listener.on_removed(keys, sizes, reason)

    def _free(self, entry: Entry) -> None:
        self.pool.free(entry.obj)
