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
- **expiry** — a lease ends by itself ``ttl_s`` after its lookup started,
  however much it is used, since the locks it holds were taken then and
  lapse at the L1 read-lock TTL whatever the lease does. ``ttl_s`` is kept
  below that TTL and the node sweeps often enough that a lease ends before
  its locks could lapse under it. Should one be reached later anyway (a
  stalled sweep), its locks are dropped, not released: a lapsed lock's
  count may already be a newer reader's, and releasing it would let
  eviction reuse memory that reader is copying;
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
    #: When the lease ends (its lookup's start + ttl_s), and when its locks lapse in
    #: L1 (the start + the read-lock TTL; no lock of it was taken before the start).
    deadline: float
    lapses_at: float


@dataclass(frozen=True, slots=True)
class _Pending:
    owner: str
    started: float


@dataclass
class LeaseStats:
    """Counters of the node's lookup leases (``GetStatus``, metrics)."""

    granted: int = 0
    ended: int = 0
    expired: int = 0
    ended_by_owner: int = 0
    consumed_locks: int = 0
    released_locks: int = 0
    #: Locks a lease still held when they lapsed in L1, dropped unreleased.
    lapsed_locks: int = 0


@dataclass
class LookupLeases:
    """The node's lookup leases by id (event loop only)."""

    manager: StorageManager
    ttl_s: float
    #: The L1 read-lock TTL, on the same clock: a lease's locks lapse this long after its lookup.
    read_ttl_s: float
    clock: Callable[[], float] = time.monotonic
    stats: LeaseStats = field(default_factory=LeaseStats)
    _leases: dict[str, _Lease] = field(default_factory=dict)
    #: Lookups whose prefetch has not been delivered yet: owner and start.
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.ttl_s < self.read_ttl_s:
            raise ValueError(
                f"the lease TTL ({self.ttl_s} s) must be positive and below the L1 read-lock "
                f"TTL ({self.read_ttl_s} s)"
            )

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

    def expect(self, lease_id: str, owner: str, started: float | None = None) -> None:
        """A lookup started under ``lease_id`` for ``owner`` (its prefetch runs).

        ``started``: when it started, before it took any lock (default: now).
        """
        self._pending[lease_id] = _Pending(owner, self.clock() if started is None else started)

    def grant(self, lease_id: str, result: PrefetchResult) -> None:
        """The prefetch's result was delivered: its locks become the lease."""
        if lease_id not in self._pending:
            return  # not a leased lookup (a peer's LockPrefix takes its locks itself)
        pending = self._pending.pop(lease_id)
        hit = result.hit_chunks
        held: dict[ObjectKey, int] = {}
        chunk_of: dict[ObjectKey, int] = {}
        for i, key in enumerate(result.locked_keys):
            held[key] = held.get(key, 0) + result.num_kv_readers
            chunk_of[key] = i % hit if hit else 0  # row-major over the prefix: the column
        self._leases[lease_id] = _Lease(
            lease_id,
            pending.owner,
            held,
            chunk_of,
            deadline=pending.started + self.ttl_s,
            lapses_at=pending.started + self.read_ttl_s,
        )
        self.stats.granted += 1

    def forget_pending(self, lease_id: str) -> str | None:
        """A lookup whose prefetch was abandoned before delivery: its owner, if it had one."""
        pending = self._pending.pop(lease_id, None)
        return pending.owner if pending is not None else None

    def remaining_s(self, lease_id: str) -> float:
        """Seconds until the lease ends by itself (0 when it is not alive)."""
        lease = self._leases.get(lease_id)
        return max(0.0, lease.deadline - self.clock()) if lease is not None else 0.0

    def _alive(self, lease_id: str) -> _Lease | None:
        """The lease, unless it is unknown or past its deadline (then it ends now)."""
        lease = self._leases.get(lease_id) if lease_id else None
        if lease is not None and lease.deadline <= self.clock():
            self._expire(lease)
            return None
        return lease

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
        lease = self._alive(lease_id)
        if lease is None:
            return [False] * len(keys)
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
        lease = self._alive(lease_id)
        if lease is None:
            return 0
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
        if keys and self.clock() >= lease.lapses_at:
            # Lapsed in L1: the counts may be newer readers' by now (see the module doc).
            logger.warning(
                "lookup lease %s (owner %r) outlived its %d read locks (read TTL %.0f s); "
                "dropped them without releasing",
                lease.lease_id,
                lease.owner,
                sum(counts),
                self.read_ttl_s,
            )
            self.stats.lapsed_locks += sum(counts)
            return 0
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
        running = [lid for lid, pending in self._pending.items() if pending.owner == owner]
        return ended, running

    def expire(self) -> int:
        """End the leases past their deadline; how many."""
        now = self.clock()
        expired = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in expired:
            self._expire(lease)
        return len(expired)

    def _expire(self, lease: _Lease) -> None:
        del self._leases[lease.lease_id]
        released = self._end(lease)
        self.stats.expired += 1
        logger.info(
            "lookup lease %s (owner %r) reached its %.0f s TTL: released its %d locks",
            lease.lease_id,
            lease.owner,
            self.ttl_s,
            released,
        )
