"""Lookup leases: storage owns every read lock a lookup took, and releases each exactly once.

A LookupAndLock starts a prefetch under an id (:mod:`.prefetch_ids`). When its
result is delivered, the read locks it took (``readers`` per locked key)
become a **lease** under the same id: the only record of those locks. The
gateway keeps nothing but the id. Every lock leaves the lease exactly once,
by the first of:

- **consume** — a retrieve (or an engine-driven commit) takes the locks of
  the chunks it serves out of the lease *before* its copy, and releases them
  when the copy ends, whether it succeeded or failed. A failed copy never
  puts them back, so nothing can release them a second time;
- **release** — FreeLookupLocks: the locks of a range of chunks;
- **end** — EndSession: everything left, and the lease is forgotten (a
  lease whose prefetch is still running abandons it: its locks are released
  when it finishes);
- **expiry** — a lease unused for ``ttl_s`` ends by itself; the TTL is kept
  below the L1 read-lock TTL, so a lease always ends before its locks could
  lapse under it;
- **its owner going away** — a lookup names its owner (the engine instance);
  :meth:`LookupLeases.end_owner` ends all of them when the gateway reaps it.

Lease ids carry the node's incarnation (the prefetch ids do), so a restarted
node never honours a lease of the one before: to it the id is unknown.
Everything here runs on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.controllers.prefetch_types import PrefetchResult
from kvmesh.storage.core.manager import StorageManager

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Lease:
    lease_id: str
    owner: str
    #: Locks still held per key, and each key's chunk in the prompt's prefix.
    held: dict[ObjectKey, int]
    chunk_of: dict[ObjectKey, int]
    deadline: float


@dataclass
class LeaseStats:
    """Counters of the node's lookup leases (``GetStatus``, metrics)."""

    granted: int = 0
    ended: int = 0
    expired: int = 0
    ended_by_owner: int = 0
    consumed_locks: int = 0
    released_locks: int = 0


@dataclass
class LookupLeases:
    """The node's lookup leases by id (event loop only)."""

    manager: StorageManager
    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    stats: LeaseStats = field(default_factory=LeaseStats)
    _leases: dict[str, _Lease] = field(default_factory=dict)
    #: Owners of lookups whose prefetch has not been delivered yet.
    _pending: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._leases)

    def ids(self) -> set[str]:
        """The ids of the leases alive now."""
        return set(self._leases)

    @property
    def held_locks(self) -> int:
        """Read locks the leases hold right now."""
        return sum(sum(lease.held.values()) for lease in self._leases.values())

    # ------------------------------------------------------------------ life

    def expect(self, lease_id: str, owner: str) -> None:
        """A lookup started under ``lease_id`` for ``owner`` (its prefetch runs)."""
        self._pending[lease_id] = owner

    def grant(self, lease_id: str, result: PrefetchResult) -> None:
        """The prefetch's result was delivered: its locks become the lease."""
        if lease_id not in self._pending:
            return  # not a leased lookup (a peer's LockPrefix takes its locks itself)
        owner = self._pending.pop(lease_id)
        hit = result.hit_chunks
        held: dict[ObjectKey, int] = {}
        chunk_of: dict[ObjectKey, int] = {}
        for i, key in enumerate(result.locked_keys):
            held[key] = held.get(key, 0) + result.num_kv_readers
            chunk_of[key] = i % hit if hit else 0  # row-major over the prefix: the column
        self._leases[lease_id] = _Lease(lease_id, owner, held, chunk_of, self._deadline())
        self.stats.granted += 1

    def forget_pending(self, lease_id: str) -> str | None:
        """A lookup whose prefetch was abandoned before delivery: its owner, if it had one."""
        return self._pending.pop(lease_id, None)

    def _deadline(self) -> float:
        return self.clock() + self.ttl_s

    def _release(self, keys: list[ObjectKey], counts: list[int]) -> int:
        """Give locks back to L1, grouped by count (one call per distinct count)."""
        by_count: dict[int, list[ObjectKey]] = {}
        for key, count in zip(keys, counts, strict=True):
            by_count.setdefault(count, []).append(key)
        for count, group in by_count.items():
            self.manager.finish_read(group, count)
        released = sum(counts)
        self.stats.released_locks += released
        return released

    # ------------------------------------------------------------ operations

    def consume(self, lease_id: str, keys: Sequence[ObjectKey]) -> list[bool]:
        """Take one lock per key of ``keys`` out of the lease; which keys had one.

        The caller releases the flagged keys' locks once its copy ends (success
        or not). An unknown lease (ended, expired, another incarnation's, or
        "") consumes nothing.
        """
        lease = self._leases.get(lease_id) if lease_id else None
        if lease is None:
            return [False] * len(keys)
        lease.deadline = self._deadline()
        mask = []
        for key in keys:
            left = lease.held.get(key, 0)
            if left > 0:
                lease.held[key] = left - 1
            mask.append(left > 0)
        self.stats.consumed_locks += sum(mask)
        return mask

    def release(self, lease_id: str, first_chunk: int, last_chunk: int) -> int:
        """Release the locks the lease still holds on chunks [first, last); how many."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0
        lease.deadline = self._deadline()
        keys = [
            k
            for k, n in lease.held.items()
            if n > 0 and first_chunk <= lease.chunk_of[k] < last_chunk
        ]
        counts = [lease.held[k] for k in keys]
        for key in keys:
            lease.held[key] = 0
        return self._release(keys, counts)

    def end(self, lease_id: str) -> tuple[bool, int]:
        """Release everything the lease holds and forget it: (it existed, locks released)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False, 0
        self.stats.ended += 1
        return True, self._end(lease)

    def _end(self, lease: _Lease) -> int:
        keys = [k for k, n in lease.held.items() if n > 0]
        counts = [lease.held[k] for k in keys]
        lease.held.clear()
        return self._release(keys, counts)

    def end_owner(self, owner: str) -> tuple[int, list[str]]:
        """End every lease of ``owner``: (leases ended, ids of its still-running lookups)."""
        if not owner:
            return 0, []
        ended = 0
        for lease_id, lease in list(self._leases.items()):
            if lease.owner == owner:
                del self._leases[lease_id]
                self._end(lease)
                ended += 1
        self.stats.ended_by_owner += ended
        running = [lid for lid, who in self._pending.items() if who == owner]
        return ended, running

    def expire(self) -> int:
        """End the leases unused for the TTL; how many."""
        now = self.clock()
        expired = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        for lease_id in expired:
            lease = self._leases.pop(lease_id)
            released = self._end(lease)
            logger.info(
                "lookup lease %s (owner %r) unused for %.0f s: released its %d locks",
                lease_id,
                lease.owner,
                self.ttl_s,
                released,
            )
        self.stats.expired += len(expired)
        return len(expired)
