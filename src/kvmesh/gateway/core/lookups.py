"""Lookups and their read locks: lock, report prefetch status, release exactly once.

Lock accounting. A lookup read-locks every key of its hit prefix
``num_kv_readers`` times (one row per kv rank). The session records how many
of those locks are still held per (rank, chunk); Retrieve releases one per
retrieved chunk of its rank (:meth:`LookupLocks.take_release_mask`),
FreeLookupLocks releases what is left in a range, and EndSession or session
expiry release everything that remains. So a lock is released exactly once,
and an aborted request never pins memory until the storage-side TTL (LMCache
leaks them until then).

A Lookup whose engine goes away mid-call (closed channel, passed deadline)
still gives back the locks storage took for it, and locks whose release
storage refused or never received stay counted until a retry, EndSession or
expiry releases them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Sequence

import numpy as np

from kvmesh.common.errors import InvalidArgument, NotFound
from kvmesh.common.keys import validate_cache_salt, validate_model_name, worker_kv_rank
from kvmesh.common.node_types import PrefetchState

from .engines import EngineRegistry
from .node_storage import KeyGridSpec, NodeStorage
from .sessions import LookupState, Session, SessionTable
from .types import GatewayStats, PrefetchStatus, PromptRangeSpec

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
    ) -> tuple[PrefetchStatus, int]:
        """Hash the prompt and lock its cached prefix; returns (status, requested chunks)."""
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
                lookup = LookupState(model_name, world_size, cache_salt, readers, n_chunks, [], "")
                self._complete(lookup, PrefetchState("", True))
                session.lookup = lookup
                return self._status(lookup), n_chunks
            ranks = [worker_kv_rank(world_size, r) for r in range(world_size)]
            chunk_bytes = self.engines.chunk_bytes_for(model_name, world_size)
            grid = KeyGridSpec(model_name, cache_salt, ranks, hashes, chunk_bytes)
            lookup = LookupState(model_name, world_size, cache_salt, readers, n_chunks, hashes, "")
            if self.storage.cancel_safe:
                state = await self.storage.lookup_and_lock(request_id, grid, readers, wait_ms)
                return self._adopt(session, lookup, state), n_chunks
            call = asyncio.ensure_future(
                self.storage.lookup_and_lock(request_id, grid, readers, wait_ms)
            )
            try:
                # Shielded: if the engine goes away mid-call (channel closed, deadline
                # passed), storage still answers and the locks it took are given back.
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
        lookup.remaining = [[lookup.readers] * lookup.hit_chunks for _ in range(lookup.world_size)]
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
        )

    # -------------------------------------------------------- callers gone away

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release_abandoned(
        self, lookup: LookupState, call: asyncio.Future[PrefetchState]
    ) -> None:
        """Give back what a lookup locked after its caller went away (no session knows it)."""
        try:
            state = await call
        except Exception:  # storage failed the lookup, so it locked nothing
            return
        lookup.prefetch_id = state.prefetch_id
        if state.completed:
            self._complete(lookup, state, counted=False)
        try:
            await self._release_lookup(lookup)
        except Exception:
            logger.exception("releasing the locks of an abandoned lookup failed")

    def _late_status(self, lookup: LookupState, call: asyncio.Future[PrefetchState]) -> None:
        """Record a prefetch status that arrived after its caller went away.

        Storage delivers a completed result once; recording it keeps the locks
        counted so EndSession or expiry releases them. A lookup released in the
        meantime is marked completed already and ignores it.
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
        """Release every lock a lookup still holds (or abandon its prefetch)."""
        if not lookup.completed:
            await self.storage.release_prefetch(lookup.prefetch_id)
            lookup.completed = True
            lookup.hit_chunks = 0
            return 0
        return await self._release_remaining(lookup, 0, lookup.hit_chunks)

    async def _release_remaining(self, lookup: LookupState, first: int, last: int) -> int:
        """Release the locks still held on chunks [first, last) of every rank.

        Callers hold the session lock. A cell is zeroed only after storage took
        its release, so when storage is unreachable the locks stay counted and
        a retried EndSession (or the session's expiry) releases them later.
        """
        ranks = lookup.kv_ranks()
        released = 0
        # Group rows by identical remaining counts so one RPC covers many keys.
        batches: dict[tuple[int, int, int], list[int]] = {}
        for r in range(len(ranks)):
            row = lookup.remaining[r] if r < len(lookup.remaining) else []
            stop = min(last, len(row))
            c = first
            while c < stop:
                count = row[c]
                if count <= 0:
                    c += 1
                    continue
                end = c + 1
                while end < stop and row[end] == count:
                    end += 1
                batches.setdefault((count, c, end), []).append(r)
                c = end
        for (count, lo, hi), rows in batches.items():
            grid = KeyGridSpec(
                lookup.model_name,
                lookup.cache_salt,
                [ranks[r] for r in rows],
                lookup.chunk_hashes[lo:hi],
            )
            await self.storage.release_locks(grid, count)
            for r in rows:
                lookup.remaining[r][lo:hi] = [0] * (hi - lo)
            batch = count * len(rows) * (hi - lo)
            released += batch
            self.counters.locks_released += batch
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
            if not status.completed or first >= last:
                return 0
            return await self._release_remaining(session.lookup, first, last)

    def take_release_mask(
        self,
        session: Session,
        worker_id: int,
        first: int,
        last: int,
        rng: PromptRangeSpec | None = None,
    ) -> list[bool]:
        """Which chunks of [first, last) hold a lookup lock of this worker (and consume it).

        With ``rng``, only a lookup of the same model, world size and salt
        counts; without, the session's lookup as it is. Callers hold the
        session lock, and hand the mask to storage, which releases the flagged
        locks with the transfer.
        """
        lookup = session.lookup
        mask = [False] * (last - first)
        if (
            lookup is None
            or not lookup.completed
            or (
                rng is not None
                and not lookup.matches(rng.model_name, rng.world_size, rng.cache_salt)
            )
            or worker_id >= len(lookup.remaining)
        ):
            return mask
        row = lookup.remaining[worker_id]
        for c in range(first, min(last, lookup.hit_chunks)):
            if row[c] > 0:
                row[c] -= 1
                mask[c - first] = True
        return mask

    async def restore_mask(
        self,
        session: Session,
        lookup: LookupState | None,
        worker_id: int,
        first: int,
        mask: Sequence[bool],
    ) -> None:
        """Count lookup locks consumed by a refused transfer as held again.

        Storage refused the call before releasing them; without this they
        would be released by no one until storage's read TTL. If the lookup
        has been replaced or ended since, nobody counts them any more, so they
        are released here.
        """
        if lookup is None or not any(mask):
            return
        async with session.lock:
            current = session.lookup is lookup and self.sessions.is_current(session)
            if current and worker_id < len(lookup.remaining):
                row = lookup.remaining[worker_id]
                for i, flag in enumerate(mask):
                    if flag:
                        row[first + i] += 1
                return
        hashes = [h for h, flag in zip(lookup.chunk_hashes[first:], mask, strict=False) if flag]
        grid = KeyGridSpec(
            lookup.model_name,
            lookup.cache_salt,
            [worker_kv_rank(lookup.world_size, worker_id)],
            hashes,
        )
        await self.storage.release_locks(grid, 1)

    # ------------------------------------------------------------- session ends

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
