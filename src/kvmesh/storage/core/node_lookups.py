"""A node's lookups: LookupAndLock, prefetch status, and the leases their locks become.

A lookup read-locks the prefix present in every row of its key grid (loading
L2 hits into L1 first) under a prefetch id (:mod:`.prefetch_ids`). An
engine's lookup is *leased* (:mod:`.lookup_leases`): once its result is
delivered, storage alone holds the record of its locks under the same id, and
releases each exactly once. A peer's LockPrefix (P2P) takes the locks itself
instead (``leased=False``), as it always did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey, validate_object_keys
from kvmesh.common.node_types import PrefetchState
from kvmesh.storage.core.lookup_leases import LookupLeases
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.prefetch_ids import PrefetchIds

MAX_CHUNK_BYTES = 1 << 31


class NodeLookups:
    """Lookups, prefetches and lookup leases of one node (event loop only)."""

    def __init__(
        self,
        manager: StorageManager,
        *,
        new_id: Callable[[str], str],
        max_chunks: int,
        lease_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.max_chunks = max_chunks
        self.leases = LookupLeases(
            manager, ttl_s=lease_ttl_s, read_ttl_s=manager.l1.read_ttl_s, clock=clock
        )
        self.prefetches = PrefetchIds(manager, new_id=new_id, on_complete=self.leases.grant)

    async def lookup_and_lock(
        self,
        request_id: str,
        rows: Sequence[Sequence[ObjectKey]],
        readers: int,
        wait_ms: int,
        chunk_bytes: int = 0,
        *,
        allow_peers: bool = True,
        owner: str = "",
        leased: bool = True,
    ) -> PrefetchState:
        """Lock the prefix present in every row (loading L2 hits); maybe wait for it.

        ``chunk_bytes`` (0 = unknown) sizes L2 objects this node has not indexed
        (written by another node of a shared pool since this one started).
        ``allow_peers`` False keeps the lookup on this node (a peer's request).
        ``leased`` lookups become a lease owned by ``owner`` (see the module
        docstring); the prefetch id is the lease id.
        """
        if not rows:
            raise InvalidArgument("the key grid has no kv_ranks", field="keys.kv_ranks")
        ranks = [row[0].kv_rank for row in rows if row]
        if len(set(ranks)) < len(ranks):
            # A repeated rank would lock each chunk twice and release it once.
            raise InvalidArgument("keys.kv_ranks must be distinct", field="keys.kv_ranks")
        width = len(rows[0])
        if width * len(rows) > self.max_chunks * 8:
            raise InvalidArgument("the key grid is too large", field="keys")
        for r, row in enumerate(rows):
            if len(row) > self.max_chunks:
                raise InvalidArgument(
                    f"{len(row)} chunks exceed this node's limit of {self.max_chunks} per request",
                    field=f"keys.rows[{r}]",
                )
            validate_object_keys(row, f"keys.rows[{r}]")
        if readers > 128:
            raise InvalidArgument("num_kv_readers must be <= 128", field="num_kv_readers")
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise InvalidArgument("chunk_bytes is too large", field="chunk_bytes")
        row_nbytes = [chunk_bytes] * len(rows) if chunk_bytes else None
        started = self.leases.clock()  # before the prefetch takes any lock
        handle = self.manager.submit_prefetch(
            request_id, rows, max(readers, 1), row_nbytes=row_nbytes, allow_peers=allow_peers
        )
        prefetch_id = self.prefetches.add(handle)
        if leased:
            self.leases.expect(prefetch_id, owner, started)
        try:
            return await self.prefetch_status(prefetch_id, wait_ms)
        except asyncio.CancelledError:
            # The caller went away while waiting and never learned the id, so nobody
            # else could release its locks before the read TTL: give them back.
            self.end_lease(prefetch_id)
            raise

    async def prefetch_status(self, prefetch_id: str, wait_ms: int) -> PrefetchState:
        """Status of a prefetch; a completed result is delivered once (and leased, if it is)."""
        state = await self.prefetches.status(prefetch_id, wait_ms)
        if state.completed and prefetch_id in self.leases.ids():
            remaining_ms = int(self.leases.remaining_s(prefetch_id) * 1000)
            return dataclasses.replace(state, lease_ttl_ms=remaining_ms)
        return state

    def release_prefetch(self, prefetch_id: str) -> bool:
        """Abandon a prefetch: its locks are released as soon as it finishes (now if it has)."""
        self.leases.forget_pending(prefetch_id)
        return self.prefetches.release(prefetch_id)

    def end_lease(self, lease_id: str) -> tuple[bool, int]:
        """End a lookup's lease, or abandon its prefetch if it runs: (existed, locks released)."""
        existed, released = self.leases.end(lease_id)
        if existed:
            return True, released
        return self.release_prefetch(lease_id), 0

    def end_owner(self, owner: str) -> int:
        """End every lease and running lookup of ``owner``; how many."""
        ended, running = self.leases.end_owner(owner)
        for lease_id in running:
            self.release_prefetch(lease_id)
        return ended + len(running)

    def expire(self) -> int:
        """End leases past their TTL, forget prefetches expired unqueried; leases ended."""
        for prefetch_id in self.prefetches.forget_expired():
            self.leases.forget_pending(prefetch_id)
        return self.leases.expire()
