"""Lookups and their leases: lock, report prefetch status, end exactly once.

A lookup read-locks every key of its hit prefix ``num_kv_readers`` times (one
row per kv rank), and **storage owns those locks**, as a lease under the
lookup's prefetch id (``kvmesh.storage.core.lookup_leases``): a Retrieve
names the lease and storage takes the locks of the chunks it serves out of
it, FreeLookupLocks releases a range, EndSession (or the session's expiry, a
new lookup of the same request, the reaping of the engine instance that
looked up) ends it. The gateway keeps only the lease's id: no lock counts, and
no guess from a failed call's status code about what storage released. An
aborted request never pins memory until a TTL (LMCache leaks them until
then), and a lock is never released twice (LMCache's double release could
drop another request's lock).

A Lookup whose engine goes away mid-call (closed channel, passed deadline)
still ends the lease storage made for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine

import numpy as np

from kvmesh.common.errors import InvalidArgument, NotFound
from kvmesh.common.keys import validate_cache_salt, validate_model_name, worker_kv_rank
from kvmesh.common.node_types import PrefetchState

from .engines import EngineRegistry
from .node_storage import KeyGridSpec, NodeStorage
from .sessions import LookupState, Session, SessionTable
from .types import GatewayStats, PrefetchStatus

logger = logging.getLogger(__name__)

MAX_KV_READERS = 128


class LookupLocks:
    """Lookups of request sessions and every release of the read locks they took."""

    def __init__(
        self,
        storage: NodeStorage,
        sessions: SessionTable,
        engines: EngineRegistry,
        counters: GatewayStats,
        *,
        chunk_size: int,
        max_wait_ms: int,
    ) -> None:
        self.storage = storage
        self.sessions = sessions
        self.engines = engines
        self.counters = counters
        self.chunk_size = chunk_size
        self.max_wait_ms = max_wait_ms
        # Clean-ups of calls whose engine went away mid-call (kept so they are not collected).
        self._tasks: set[asyncio.Task[None]] = set()

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
        owner: str = "",
    ) -> tuple[PrefetchStatus, int]:
        """Hash the prompt and lock its cached prefix; returns (status, requested chunks).

        ``owner`` (the engine instance) owns the lease; its reaping ends it.
        """
        if not request_id:
            raise InvalidArgument("request_id must not be empty", field="request_id")
        validate_model_name(model_name)
        validate_cache_salt(cache_salt)
        if not 1 <= world_size <= 255:
            raise InvalidArgument("world_size must be in [1, 255]", field="world_size")
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
        self.engines.seen_owner(owner)
        self.counters.lookups += 1
        self.counters.lookup_requested_tokens += n_chunks * self.chunk_size
        session = self.sessions.open(request_id)
        async with session.lock:
            self.sessions.take_tokens(session, token_ids)
            if session.lookup is not None:
                await self._release_lookup(session.lookup)
                session.lookup = None
            hashes = self.sessions.hashes(session, n_chunks)
            if n_chunks == 0 or not self.engines.serves(model_name, world_size):
                if n_chunks:
                    self.counters.lookups_without_engine += 1
                lookup = LookupState(
                    model_name, world_size, cache_salt, readers, n_chunks, [], "", owner
                )
                self._complete(lookup, PrefetchState("", True))
                session.lookup = lookup
                return self._status(lookup), n_chunks
            ranks = [worker_kv_rank(world_size, r) for r in range(world_size)]
            chunk_bytes = self.engines.chunk_bytes_for(model_name, world_size)
            grid = KeyGridSpec(model_name, cache_salt, ranks, hashes, chunk_bytes)
            lookup = LookupState(
                model_name, world_size, cache_salt, readers, n_chunks, hashes, "", owner
            )
            if self.storage.cancel_safe:
                state = await self.storage.lookup_and_lock(
                    request_id, grid, readers, wait_ms, owner
                )
                return self._adopt(session, lookup, state), n_chunks
            call = asyncio.ensure_future(
                self.storage.lookup_and_lock(request_id, grid, readers, wait_ms, owner)
            )
            try:
                # Shielded: if the engine goes away mid-call (channel closed, deadline
                # passed), storage still answers, and the lease it made is ended.
                state = await asyncio.shield(call)
            except asyncio.CancelledError:
                self._background(self._release_abandoned(lookup, call))
                raise
            return self._adopt(session, lookup, state), n_chunks

    def _check_wait(self, wait_ms: int, field_name: str) -> int:
        """``wait_ms``, refused above the gateway's maximum server-side wait."""
        if wait_ms > self.max_wait_ms:
            raise InvalidArgument(
                f"{field_name} {wait_ms} exceeds the gateway's maximum of {self.max_wait_ms} ms",
                field=field_name,
            )
        return wait_ms

    def _adopt(self, session: Session, lookup: LookupState, state: PrefetchState) -> PrefetchStatus:
        """Make a started lookup the session's; its status."""
        lookup.prefetch_id = state.prefetch_id
        if state.completed:
            self._complete(lookup, state)
        session.lookup = lookup
        return self._status(lookup)

    def _complete(self, lookup: LookupState, state: PrefetchState, *, counted: bool = True) -> None:
        lookup.completed = True
        lookup.hit_chunks = min(state.hit_chunks, lookup.requested_chunks)
        lookup.l1_hit_chunks = state.l1_hit_chunks
        lookup.l2_hit_chunks = state.l2_hit_chunks
        lookup.lease_ttl_ms = state.lease_ttl_ms
        if not counted:
            return
        self.counters.lookup_hit_tokens += lookup.hit_chunks * self.chunk_size
        self.counters.lookup_l1_hit_chunks += lookup.l1_hit_chunks
        self.counters.lookup_l2_hit_chunks += lookup.l2_hit_chunks

    def _status(self, lookup: LookupState) -> PrefetchStatus:
        if not lookup.completed:
            return PrefetchStatus(False)
        return PrefetchStatus(
            True,
            lookup.hit_chunks,
            lookup.hit_chunks * self.chunk_size,
            lookup.l1_hit_chunks,
            lookup.l2_hit_chunks,
            lookup.lease_id,
            lookup.lease_ttl_ms,
        )

    # -------------------------------------------------------- callers gone away

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release_abandoned(
        self, lookup: LookupState, call: asyncio.Future[PrefetchState]
    ) -> None:
        """End the lease of a lookup whose caller went away (no session knows it)."""
        try:
            state = await call
        except Exception:  # storage failed the lookup, so it locked nothing
            return
        try:
            await self.storage.end_lease(state.prefetch_id)
        except Exception:  # its TTL ends it
            logger.exception("ending the lease of an abandoned lookup failed")

    def _late_status(self, lookup: LookupState, call: asyncio.Future[PrefetchState]) -> None:
        """Record a prefetch status that arrived after its caller went away.

        Storage delivers a completed result once; recording it lets later
        retrieves use the lease (EndSession ends it either way). A lookup
        ended in the meantime ignores it.
        """
        if call.cancelled() or call.exception() is not None:
            return
        state = call.result()
        if state.completed and not lookup.completed:
            self._complete(lookup, state)

    async def close(self, timeout: float = 5.0) -> None:
        """Let background lock releases finish (bounded), then cancel what is left."""
        pending = set(self._tasks)
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    # ---------------------------------------------------------- prefetch status

    async def _poll(self, session: Session, wait_ms: int) -> PrefetchStatus:
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

    async def query_prefetch_status(self, request_id: str) -> PrefetchStatus:
        """Non-blocking status of a request's lookup."""
        session = self.sessions.existing(request_id)
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
        session = self.sessions.existing(request_id)
        async with session.lock:
            return await self._poll(session, timeout_ms)

    # ------------------------------------------------------------------ release

    async def _release_lookup(self, lookup: LookupState) -> int:
        """End the lookup's lease (or abandon its running prefetch); locks released."""
        if lookup.ended:
            return 0
        released = await self.storage.end_lease(lookup.prefetch_id) if lookup.prefetch_id else 0
        lookup.ended = True
        lookup.completed = True
        self.counters.locks_released += released
        return released

    async def free_lookup_locks(self, request_id: str, start_token: int, end_token: int) -> int:
        """Release the lookup locks held on chunks in [start_token, end_token)."""
        self.sessions.chunk_range(start_token, end_token, None)
        session = self.sessions.existing(request_id)
        async with session.lock:
            if session.lookup is None:
                raise NotFound(f"request {request_id!r} has no lookup", reason="NO_LOOKUP")
            first, last = self.sessions.chunk_range(start_token, end_token, session.tokens.size)
            status = await self._poll(session, 0)
            lease_id = session.lookup.lease_id
            if not status.completed or first >= last or not lease_id:
                return 0
            released = await self.storage.release_lease(lease_id, first, last)
            self.counters.locks_released += released
            return released

    # ------------------------------------------------------------- session ends

    async def end_owner(self, owner: str) -> int:
        """End the sessions and leases of a gone engine instance; leases ended in storage."""
        for session in self.sessions.owned_by(owner):
            self.sessions.pop(session.request_id)
            async with session.lock:
                session.lookup = None  # storage ends its lease below, with the rest
        return await self.storage.end_owner_leases(owner)

    async def end_session(self, request_id: str) -> tuple[bool, int]:
        """End a request: release what it still holds, refresh LRU of its chunks."""
        session = self.sessions.pop(request_id)
        if session is None:
            return False, 0
        async with session.lock:
            try:
                return True, await self._close_session(session, touch=True)
            except BaseException:
                # Storage did not take the release (unreachable): keep the session, so
                # the engine's retry, or the session's expiry, releases the locks later.
                self.sessions.keep(session)
                raise

    async def expire_idle(self, now: float) -> None:
        """Expire sessions idle past the TTL at ``now``, releasing their locks."""
        for session in self.sessions.idle(now):
            if not self.sessions.is_current(session):
                continue
            self.sessions.pop(session.request_id)
            self.counters.sessions_expired += 1
            try:
                async with session.lock:
                    await self._close_session(session, touch=False)
            except Exception:
                # Kept (unless the request came back meanwhile): the next sweep retries.
                self.sessions.keep(session)
                logger.exception(
                    "releasing the locks of expired session %s failed", session.request_id
                )

    async def _close_session(self, session: Session, touch: bool) -> int:
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

    async def _touch(self, request_id: str, lookup: LookupState) -> None:
        grid = KeyGridSpec(
            lookup.model_name, lookup.cache_salt, lookup.kv_ranks(), lookup.chunk_hashes
        )
        try:
            await self.storage.touch(grid)
        except Exception:  # LRU recency only: never fails the release
            logger.warning("refreshing the LRU recency of request %s failed", request_id)
