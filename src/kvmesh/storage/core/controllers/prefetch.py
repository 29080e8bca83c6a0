"""PrefetchController: lookup over L1 and L2, and loading of the missing prefix from L2.

A request is a grid of keys: rows are kv ranks / object groups, columns are
chunks. A column counts only when every row has it, and only the contiguous
prefix of counting columns is served (as in LMCache 0.5.6):

1. Read-lock every L1 hit ``num_kv_readers`` times (synchronously, in
   ``submit``). When L1 alone covers the whole grid, when no L2 adapter is
   available, or when the adapters' complete indexes show that the first
   missing column is missing from L2 too (and no peer could have it: see
   :meth:`PrefetchController._column_surely_missing`), the result is ready
   before ``submit`` returns.
2. Otherwise a worker (at most ``max_in_flight`` requests at once, the rest
   wait in FIFO order) pins the missing cells in each adapter and asks it
   which it holds (``contains``), lowest adapter first.
3. Plan: the longest column prefix that L1 ∪ L2 can serve; nothing after the
   first missing column is ever loaded, and L1 locks after it are released.
4. Reserve L1 staging for the planned cells, load them (``get_into``) and
   publish them with ``num_kv_readers`` read locks: *temporary* objects
   (freed when their last reader is done) under the ``default`` policy,
   ordinary resident ones under ``retain``. An out-of-memory reservation or a
   failed load shortens the prefix; everything after it is released.
5. With a peer source (P2P, :mod:`~kvmesh.storage.core.peer.fetch`) and
   columns still missing, the request is handed to it: it fetches the
   missing prefix from another node into L1 (read-locked like an L2 load)
   on its own threads, so a slow peer never holds a prefetch worker, and
   the request finishes when it answers. A peer's own request never goes
   to peers (``allow_peers=False``).
6. The result is kept until it is queried, exactly once (or until
   ``result_ttl_s`` passes unqueried: then its locks are released, or
   dropped unreleased if they lapsed first, since a lapsed lock's count may
   be a newer reader's; the node keeps the TTL below the read TTL). Whoever
   needs to know when it is ready registers ``add_done_callback``; the
   worker calls it on completion, so no thread ever parks waiting for a
   prefetch (``wait`` remains for synchronous callers and tests).

A degraded or failing adapter only turns its cells into misses; an
unexpected error aborts the request into an all-miss result with every lock,
pin and staging object released. Nothing raised here reaches the caller of
``query``/``wait`` except ``NotFound`` for an unknown or consumed handle.

This module queues the requests and keeps their results; steps 2 to 4, one
request's load, live in :mod:`~kvmesh.storage.core.controllers.prefetch_job`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvmesh.common.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.controllers.l2tier import L2Tier
from kvmesh.storage.core.controllers.prefetch_job import PrefetchHandle, PrefetchJob, PrefetchLoader
from kvmesh.storage.core.controllers.prefetch_types import (
    PeerSource,
    PrefetchPolicy,
    PrefetchResult,
)
from kvmesh.storage.core.l1.manager import MAX_READ_LOCKS_PER_CALL, L1Manager
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.pins import PinTable

logger = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 8
#: 0.8 of the default read-lock TTL: an unqueried result's locks go back before they lapse.
DEFAULT_RESULT_TTL_S = 240.0


DoneCallback = Callable[[PrefetchHandle], None]


class PrefetchController:
    """Runs prefetch requests and keeps their results until queried.

    Threads: a pool of ``max_in_flight`` workers (``kvmesh-prefetch``) whose
    queue is FIFO. ``close()`` lets running requests finish, aborts queued
    ones (releasing their locks) and joins the workers.
    """

    def __init__(
        self,
        l1: L1Manager,
        tiers: Sequence[L2Tier],
        pins: PinTable,
        *,
        policy: PrefetchPolicy = PrefetchPolicy.DEFAULT,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        result_ttl_s: float = DEFAULT_RESULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_in_flight < 1:
            raise InvalidArgument("max_in_flight must be >= 1", field="max_in_flight")
        self.l1 = l1
        self.tiers = list(tiers)
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.result_ttl_s = result_ttl_s
        self._clock = clock
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._jobs: dict[int, PrefetchJob] = {}
        #: Unqueried results in publish order, with when each was published.
        self._results: OrderedDict[int, tuple[float, PrefetchResult]] = OrderedDict()
        self._callbacks: dict[int, list[DoneCallback]] = {}
        self._closing = False
        self._peers: PeerSource | None = None
        self._loader = PrefetchLoader(
            l1,
            self.tiers,
            pins,
            temporary=policy is PrefetchPolicy.DEFAULT,
            lock=self._cond,
        )
        self._executor = ThreadPoolExecutor(
            max_workers=max_in_flight, thread_name_prefix="kvmesh-prefetch"
        )
        # Gauges and counters.
        self.queued = 0
        self.in_flight = 0
        self.submitted = 0
        self.completed = 0
        self.completed_l1_only = 0
        #: Misses answered at submit from the L2 indexes (no worker, no adapter call).
        self.completed_by_index = 0
        self.aborted = 0
        self.expired_results = 0
        self.peer_requests = 0

    def set_peer_source(self, peers: PeerSource | None) -> None:
        """Ask ``peers`` for columns that L1 and L2 miss (None: never)."""
        self._peers = peers

    # -- API ----------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        key_rows: Sequence[Sequence[ObjectKey]],
        num_kv_readers: int,
        *,
        row_nbytes: Sequence[int] | None = None,
        allow_peers: bool = True,
    ) -> PrefetchHandle:
        """Start a prefetch of the grid ``key_rows`` (rows × chunks).

        ``row_nbytes`` gives the object size of each row (needed to stage L2
        loads); without it the size comes from the adapter's index or another
        L1 object of the same row, and a cell of unknown size is a miss.
        """
        rows = [list(r) for r in key_rows]
        if rows and any(len(r) != len(rows[0]) for r in rows):
            raise InvalidArgument(
                "every key row must have the same number of chunks", field="key_rows"
            )
        nbytes: list[int] | None = None
        if row_nbytes is not None:
            nbytes = list(row_nbytes)
            if len(nbytes) != len(rows) or any(n <= 0 for n in nbytes):
                raise InvalidArgument(
                    "row_nbytes must give one positive size per key row", field="row_nbytes"
                )
        readers = min(max(num_kv_readers, 1), MAX_READ_LOCKS_PER_CALL)
        self._sweep_results()
        with self._cond:
            if self._closing:
                raise FailedPrecondition("the prefetch controller is closed")
            handle = PrefetchHandle(next(self._ids), request_id)
            self.submitted += 1
        unheld = [[False] * len(r) for r in rows]
        # Its start is taken before any lock of it (they lapse a read TTL after, at the soonest).
        job = PrefetchJob(handle, rows, readers, nbytes, unheld, started=self._clock())
        peers = self._peers
        job.allow_peers = allow_peers and peers is not None and not peers.alone()
        if job.num_chunks:
            flat = [k for r in rows for k in r]
            held = [res is L1Result.SUCCESS for res in self.l1.reserve_read(flat, readers)]
            width = job.num_chunks
            job.held = [held[i : i + width] for i in range(0, len(held), width)]
        prefix = job.held_prefix()
        if prefix == job.num_chunks or not (
            job.allow_peers or any(t.available() for t in self.tiers)
        ):
            with self._cond:
                self.completed_l1_only += 1
            self._finish(job, prefix)
            return handle
        if not job.allow_peers and self._column_surely_missing(job, prefix):
            # The common miss: answered here, with no hop to a prefetch worker
            # (under CPU contention that hop alone took milliseconds).
            with self._cond:
                self.completed_by_index += 1
            self._finish(job, prefix)
            return handle
        with self._cond:
            self._jobs[handle.id] = job
            self.queued += 1
        try:
            self._executor.submit(self._run, job)
        except RuntimeError:
            # close() shut the pool down between our check and now.
            with self._cond:
                self.queued -= 1
            self._abort(job, "storage node shutting down")
        return handle

    def _column_surely_missing(self, job: PrefetchJob, column: int) -> bool:
        """True when some row's chunk at ``column`` is in no L2 tier a load would ask.

        Known from the tiers' own indexes only (:meth:`L2Tier.surely_absent`);
        a tier that cannot tell makes this False, and the job goes to a worker.
        Degraded tiers are skipped, as :meth:`PrefetchLoader.load` skips them.
        """
        tiers = [t for t in self.tiers if t.available()]
        return any(
            all(t.surely_absent(row[column]) for t in tiers)
            for row, held in zip(job.rows, job.held, strict=True)
            if not held[column]
        )

    def query(self, handle: PrefetchHandle) -> PrefetchResult | None:
        """The result once (then forgotten); None while running; NotFound if unknown/consumed."""
        self._sweep_results()
        with self._cond:
            entry = self._results.pop(handle.id, None)
            if entry is not None:
                return entry[1]
            if handle.id in self._jobs:
                return None
        raise NotFound(
            f"prefetch {handle.id} of request {handle.request_id!r} is unknown or its result "
            "was already returned",
            reason="PREFETCH_NOT_FOUND",
        )

    def wait(self, handle: PrefetchHandle, timeout: float) -> bool:
        """Block until the result is ready (True) or ``timeout`` seconds pass (False).

        Does not consume the result; raises NotFound if unknown/consumed.
        """
        with self._cond:
            self._cond.wait_for(
                lambda: handle.id in self._results or handle.id not in self._jobs,
                timeout=max(0.0, timeout),
            )
            if handle.id in self._results:
                return True
            if handle.id in self._jobs:
                return False
        raise NotFound(
            f"prefetch {handle.id} of request {handle.request_id!r} is unknown or its result "
            "was already returned",
            reason="PREFETCH_NOT_FOUND",
        )

    def add_done_callback(self, handle: PrefetchHandle, fn: DoneCallback) -> None:
        """Call ``fn(handle)`` once the result is ready; at once (here) when it is already.

        ``fn`` runs on the prefetch worker that finished the request (or on
        the caller's thread), outside every lock of the controller: it must
        be quick and thread-safe, e.g. ``loop.call_soon_threadsafe`` or a
        ``query`` plus ``finish_read``. An exception it raises is logged.
        Raises NotFound if the handle is unknown or its result was consumed.
        """
        with self._cond:
            if handle.id in self._jobs:
                self._callbacks.setdefault(handle.id, []).append(fn)
                return
            ready = handle.id in self._results
        if not ready:
            raise NotFound(
                f"prefetch {handle.id} of request {handle.request_id!r} is unknown or its result "
                "was already returned",
                reason="PREFETCH_NOT_FOUND",
            )
        _call_back(fn, handle)

    def known(self, handle: PrefetchHandle) -> bool:
        """True while the prefetch runs or its result waits to be queried."""
        with self._cond:
            return handle.id in self._jobs or handle.id in self._results

    def sweep(self) -> int:
        """Release results nobody queried within ``result_ttl_s``; how many.

        Also done on every ``submit`` and ``query``; the storage app calls it
        from its periodic sweep so an idle node releases them too.
        """
        return self._sweep_results()

    def close(self) -> None:
        """Finish running requests, abort queued ones, join the workers. Idempotent."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
        if self._peers is not None:
            self._peers.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._cond:
            leftover = list(self._jobs.values())
        for job in leftover:
            self._abort(job, "storage node shutting down")

    def stats(self) -> dict[str, Any]:
        """Queue gauges and counters."""
        with self._cond:
            return {
                "policy": self.policy.value,
                "max_in_flight": self.max_in_flight,
                "queued": self.queued,
                "in_flight": self.in_flight,
                "unconsumed_results": len(self._results),
                "submitted": self.submitted,
                "completed": self.completed,
                "completed_l1_only": self.completed_l1_only,
                "completed_by_index": self.completed_by_index,
                "aborted": self.aborted,
                "expired_results": self.expired_results,
                "peer_requests": self.peer_requests,
                "l2_loaded_cells": self._loader.l2_loaded_cells,
                "l2_failed_cells": self._loader.l2_failed_cells,
                "oom_cells": self._loader.oom_cells,
            }

    # -- worker ---------------------------------------------------------------

    def _run(self, job: PrefetchJob) -> None:
        with self._cond:
            self.queued -= 1
            self.in_flight += 1
        try:
            end = self._loader.load(job)
            if job.allow_peers and end < job.num_chunks and self._to_peers(job, end):
                return
            self._finish(job, end)
        except Exception as exc:
            logger.exception("prefetch %s failed; answering all-miss", job.handle.request_id)
            self._abort(job, f"internal error: {exc!r}")
        finally:
            with self._cond:
                self.in_flight -= 1

    def _to_peers(self, job: PrefetchJob, end: int) -> bool:
        """Hand the columns from ``end`` on to the peer source; False when it is closed."""
        peers = self._peers
        if peers is None:
            return False
        rest = [row[end:] for row in job.rows]

        def done(got: int) -> None:
            got = max(0, min(got, job.num_chunks - end))
            with self._cond:
                alive = job.handle.id in self._jobs
            if not alive:
                # Aborted meanwhile (shutdown): give the fetched locks back.
                if got:
                    self.l1.finish_read([k for row in rest for k in row[:got]], job.readers)
                return
            for row in job.held:
                for c in range(end, end + got):
                    row[c] = True
            try:
                self._finish(job, end + got)
            except Exception as exc:
                logger.exception("prefetch %s failed after P2P", job.handle.request_id)
                self._abort(job, f"internal error: {exc!r}")

        try:
            peers.submit(job.handle.request_id, rest, job.readers, job.row_nbytes, done)
        except RuntimeError:
            return False
        with self._cond:
            self.peer_requests += 1
        return True

    def _finish(self, job: PrefetchJob, end: int, error: str = "") -> None:
        self._loader.drop_after(job, 0 if error else end)
        self._loader.release(job, end)
        locked = tuple(key for row in job.rows for key in row[:end])
        if locked:
            self.l1.touch(locked)
        l2_cells = sum(1 for c in job.loaded if c[1] < end)
        result = PrefetchResult(
            request_id=job.handle.request_id,
            hit_chunks=end,
            num_rows=len(job.rows),
            num_chunks=job.num_chunks,
            num_kv_readers=job.readers,
            l1_hit_cells=len(locked) - l2_cells,
            l2_hit_cells=l2_cells,
            locked_keys=locked,
            error=error,
            started=job.started,
        )
        self._publish(job.handle, result, completed=True)

    def _publish(self, handle: PrefetchHandle, result: PrefetchResult, completed: bool) -> None:
        """Make the result queryable, wake ``wait``, then run the done callbacks."""
        with self._cond:
            self._jobs.pop(handle.id, None)
            self._results[handle.id] = (self._clock(), result)
            if completed:
                self.completed += 1
            callbacks = self._callbacks.pop(handle.id, [])
            self._cond.notify_all()
        # Outside the lock: a callback may query (and so consume) the result.
        for fn in callbacks:
            _call_back(fn, handle)

    def _abort(self, job: PrefetchJob, error: str) -> None:
        with self._cond:
            self.aborted += 1
        try:
            self._finish(job, 0, error)
        except Exception:
            logger.exception("cleanup of prefetch %s failed", job.handle.request_id)
            self._publish(
                job.handle,
                PrefetchResult(
                    request_id=job.handle.request_id,
                    hit_chunks=0,
                    num_rows=len(job.rows),
                    num_chunks=job.num_chunks,
                    num_kv_readers=job.readers,
                    l1_hit_cells=0,
                    l2_hit_cells=0,
                    locked_keys=(),
                    error=error,
                ),
                completed=False,
            )

    def _sweep_results(self) -> int:
        """Drop results nobody queried within the TTL, releasing their locks; how many."""
        now = self._clock()
        expired: list[PrefetchResult] = []
        with self._cond:
            while self._results:
                hid, (at, result) = next(iter(self._results.items()))
                if now - at < self.result_ttl_s:
                    break
                del self._results[hid]
                expired.append(result)
            self.expired_results += len(expired)
        for result in expired:
            if not result.locked_keys:
                continue
            if self.l1.lapsed(result.started):
                # Lapsed in L1 already: their counts may be newer readers' now, and
                # releasing those would let eviction reuse memory still being read.
                logger.warning(
                    "prefetch result of request %r was never queried; its %d locks "
                    "lapsed first and are dropped",
                    result.request_id,
                    len(result.locked_keys),
                )
                continue
            logger.warning(
                "prefetch result of request %r was never queried; releasing its %d locks",
                result.request_id,
                len(result.locked_keys),
            )
            self.l1.finish_read(list(result.locked_keys), result.num_kv_readers)
        return len(expired)


def _call_back(fn: DoneCallback, handle: PrefetchHandle) -> None:
    try:
        fn(handle)
    except Exception:
        logger.exception("done callback of prefetch %s failed", handle.request_id)
