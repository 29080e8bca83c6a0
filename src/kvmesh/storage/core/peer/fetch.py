"""The asking side of P2P: fetch a prefix that L1 and L2 missed from another node.

The prefetch controller hands a request's missing columns to
:class:`PeerFetcher` (its ``PeerSource``), which on one of its own threads
(``kvmesh-p2p``, so a slow peer never holds a prefetch worker):

1. asks the coordinator which instances are alive, with their advertised
   address and incarnation (cached for a second; with no other instance the
   miss ends here), and its directory which of them hold each key (in L1 or
   in a private L2; a shared pool is this node's own L2 already);
2. picks one peer: the one holding the **longest prefix** of the columns in
   every row; ties go to the highest **rendezvous hash** of (instance id,
   first chunk hash), so concurrent askers of one prefix agree on a peer
   and different prefixes spread over the holders;
3. read-locks the prefix there (``LockPrefix`` with the incarnation the
   coordinator reported: a restarted peer refuses it), within the lookup
   timeout;
4. stages one L1 object per chunk and receives the bytes straight into them
   within the load timeout (over the peer's TCP data plane, or its
   ``ReadChunks`` stream when it has none: the link's choice), checking
   every piece before it is written: chunk index in range, offsets in order,
   no byte beyond the size the peer announced (which must match the
   request's chunk size when it has one);
5. publishes the columns that arrived whole, in order, as an ordinary store
   (resident objects that the node's events report as STORE/L1, written
   through to L2 like any store), read-locked for the asking prefetch;
   everything else is discarded: never a torn chunk.

The peer's lease ends with the stream; on any other path it is unlocked
explicitly (and its TTL is the last resort). Concurrent requests for the same
keys fetch once (**single flight**): the later ones wait for the running
fetch, then lock what it left in L1 (counted as ``joined_fetches``). Every
failure (directory down, peer gone, evicted, restarted, died mid-stream,
timed out) ends as a shorter prefix or a miss, and is counted; a fetch's
``kvmesh.p2p.fetch`` span then has an ERROR status (with the exception as an
event when there is one) and ``kvmesh.p2p.outcome`` says ``hit``, ``miss``
(no peer held the keys, or the peer locked nothing) or ``failed``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1.manager import L1Manager
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.peer.choice import pick_peer
from kvmesh.storage.core.peer.ports import (
    PeerDirectory,
    PeerLease,
    PeerLink,
    PeerTarget,
    PeerUnavailable,
)
from kvmesh.storage.core.peer.transfer import Cell, Transfer, TransferSink

logger = logging.getLogger(__name__)

_tracer = trace.get_tracer("kvmesh.storage.p2p")

DEFAULT_LOOKUP_TIMEOUT_S = 30.0
DEFAULT_LOAD_TIMEOUT_S = 30.0
DEFAULT_MAX_IN_FLIGHT = 4


@dataclass(frozen=True, slots=True)
class FetchSettings:
    """Timeouts and sizes of the asking side."""

    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT


@dataclass
class _Counters:
    fetches: int = 0
    fetched_chunks: int = 0
    fetched_bytes: int = 0
    fetch_failures: int = 0
    directory_lookups: int = 0
    joined_fetches: int = 0
    misses: int = 0
    received_bytes: int = 0


class PeerFetcher:
    """Fetches missing prefixes from peers into L1; the prefetch controller's PeerSource."""

    def __init__(
        self,
        l1: L1Manager,
        directory: PeerDirectory,
        link: PeerLink,
        *,
        instance_id: str,
        settings: FetchSettings | None = None,
        max_object_bytes: int | None = None,
    ) -> None:
        self.l1 = l1
        self.directory = directory
        self.link = link
        self.instance_id = instance_id
        self.settings = settings or FetchSettings()
        self.max_object_bytes = max_object_bytes or l1.pool.max_object_bytes
        self._lock = threading.Lock()
        self._flights: dict[tuple[ObjectKey, ...], threading.Event] = {}
        self._ids = itertools.count(1)
        self._closing = threading.Event()
        self._counters = _Counters()
        self._executor = ThreadPoolExecutor(
            max_workers=self.settings.max_in_flight, thread_name_prefix="kvmesh-p2p"
        )

    # -- PeerSource -------------------------------------------------------------

    def alone(self) -> bool:
        """True when the directory's cached membership names no other node.

        The same listing a fetch would use now (the directory keeps it for a
        moment), read without blocking: the prefetch controller then answers a
        miss without handing it here, as the fetch would have ended it at once.
        With no listing cached, False: the next fetch lists the members.
        """
        return self.known_peers() == 0

    def submit(
        self,
        request_id: str,
        rows: Sequence[Sequence[ObjectKey]],
        readers: int,
        row_nbytes: Sequence[int] | None,
        done: Callable[[int], None],
    ) -> None:
        """Fetch on a P2P thread, then ``done(columns)``; RuntimeError when closed."""
        if self._closing.is_set():
            raise RuntimeError("the P2P fetcher is closed")
        grid = [list(r) for r in rows]
        nbytes = list(row_nbytes) if row_nbytes is not None else None

        def run() -> None:
            got = 0
            try:
                got = self.fetch(request_id, grid, readers, nbytes)
            except Exception:
                logger.exception("P2P fetch of request %s failed", request_id)
            done(got)

        self._executor.submit(run)

    def close(self) -> None:
        """Cancel running transfers, wait for their threads to finish. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        self.link.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.directory.close()

    def stats(self) -> dict[str, Any]:
        """Counters of the asking side."""
        with self._lock:
            c = self._counters
            return {
                "fetches": c.fetches,
                "fetched_chunks": c.fetched_chunks,
                "fetched_bytes": c.fetched_bytes,
                "fetch_failures": c.fetch_failures,
                "directory_lookups": c.directory_lookups,
                "joined_fetches": c.joined_fetches,
                "misses": c.misses,
                "received_bytes": c.received_bytes,
                "running": len(self._flights),
                "peers": self.known_peers(),
            }

    def known_peers(self) -> int:
        """Other nodes in the membership listing a fetch would use now; -1 with none cached."""
        peers = self.directory.cached_peers()
        return -1 if peers is None else sum(1 for i in peers if i != self.instance_id)

    # -- one fetch ----------------------------------------------------------------

    def fetch(
        self,
        request_id: str,
        rows: list[list[ObjectKey]],
        readers: int,
        row_nbytes: list[int] | None,
    ) -> int:
        """Blocking: columns of ``rows`` now resident and read-locked ``readers`` times."""
        if not rows or not rows[0] or self._closing.is_set():
            return 0
        flight_key = tuple(k for row in rows for k in row)
        with self._lock:
            flight = self._flights.get(flight_key)
            leader = flight is None
            if leader:
                flight = self._flights[flight_key] = threading.Event()
            else:
                self._counters.joined_fetches += 1
        assert flight is not None
        if not leader:
            flight.wait(self.settings.lookup_timeout_s + self.settings.load_timeout_s)
            return self._claim_local(rows, readers)
        try:
            with _tracer.start_as_current_span("kvmesh.p2p.fetch") as span:
                span.set_attribute("kvmesh.request_id", request_id)
                span.set_attribute("kvmesh.p2p.chunks_asked", len(rows[0]))
                got = self._fetch(request_id, rows, readers, row_nbytes, span)
                span.set_attribute("kvmesh.p2p.chunks_fetched", got)
                return got
        finally:
            with self._lock:
                self._flights.pop(flight_key, None)
            flight.set()

    def _claim_local(self, rows: list[list[ObjectKey]], readers: int) -> int:
        """Read-lock the columns already resident (what a fetch just left), in order."""
        for c in range(len(rows[0])):
            column = [row[c] for row in rows]
            results = self.l1.reserve_read(column, readers)
            if all(r is L1Result.SUCCESS for r in results):
                continue
            held = [k for k, r in zip(column, results, strict=True) if r is L1Result.SUCCESS]
            if held:
                self.l1.finish_read(held, readers)
            return c
        return len(rows[0])

    def _fetch(
        self,
        request_id: str,
        rows: list[list[ObjectKey]],
        readers: int,
        row_nbytes: list[int] | None,
        span: Any,
    ) -> int:
        settings = self.settings
        deadline = time.monotonic() + settings.lookup_timeout_s
        try:
            # Who is alive first (cached for a second): a node alone in its fleet has
            # nobody to fetch from, and its misses skip the directory lookup.
            peers = self.directory.peers(_left(deadline))
            if not any(instance != self.instance_id for instance in peers):
                self._count(miss=True)
                span.set_attribute("kvmesh.p2p.outcome", "miss")
                return 0
            with self._lock:
                self._counters.directory_lookups += 1
            holders = self.directory.holders([k for row in rows for k in row], _left(deadline))
        except PeerUnavailable as exc:
            logger.info("P2P %s: directory unavailable: %s", request_id, exc)
            self._count(failure=True)
            _failed(span, "the directory is unavailable", exc)
            return 0
        peer, prefix = pick_peer(rows, holders, peers, self.instance_id)
        if peer is None:
            self._count(miss=True)
            span.set_attribute("kvmesh.p2p.outcome", "miss")
            return 0
        span.set_attribute("kvmesh.p2p.peer", peer.instance_id)
        with self._lock:
            self._counters.fetches += 1
        try:
            lease = self.link.lock(
                peer, [row[:prefix] for row in rows], settings.load_timeout_s, _left(deadline)
            )
        except PeerUnavailable as exc:
            logger.info("P2P %s: lock on %s failed: %s", request_id, peer.instance_id, exc)
            self._count(failure=True)
            _failed(span, f"lock on {peer.instance_id} failed", exc)
            return 0
        if lease.locked_chunks == 0 or not lease.lease_id:
            # The directory was stale (evicted, deleted since): a clean miss.
            self._count(miss=True)
            span.set_attribute("kvmesh.p2p.outcome", "miss")
            return 0
        transfer = Transfer(
            [row[: lease.locked_chunks] for row in rows], [], f"p2p:{next(self._ids)}"
        )
        try:
            columns = self._check_sizes(lease, transfer, row_nbytes)
            columns = self._stage(transfer, columns)
            if columns:
                columns = self._receive(peer, lease, transfer, columns)
            got = self._publish(transfer, columns, readers)
        finally:
            self._discard(transfer)
            if not transfer.complete:
                try:
                    self.link.unlock(peer, lease.lease_id, 2.0)
                except PeerUnavailable as exc:
                    logger.info("P2P unlock on %s failed (its TTL ends it): %s", peer, exc)
        nbytes = sum(
            transfer.sizes[c * transfer.height + r]
            for c in range(got)
            for r in range(transfer.height)
        )
        with self._lock:
            self._counters.fetched_chunks += got * transfer.height
            self._counters.fetched_bytes += nbytes
            if got < lease.locked_chunks:
                self._counters.fetch_failures += 1
        span.set_attribute("kvmesh.p2p.bytes", nbytes)
        span.set_attribute("kvmesh.p2p.chunks_locked", lease.locked_chunks)
        if got < lease.locked_chunks:
            why = transfer.problem or "the transfer ended short"
            _failed(
                span,
                f"{peer.instance_id}: {why} ({got} of {lease.locked_chunks} chunks)",
                transfer.error,
            )
        else:
            span.set_attribute("kvmesh.p2p.outcome", "hit")
        return got

    def _check_sizes(
        self, lease: PeerLease, transfer: Transfer, row_nbytes: list[int] | None
    ) -> int:
        """Columns whose announced sizes are sane (and match the expected chunk size)."""
        height = transfer.height
        sizes = list(lease.chunk_sizes)
        columns = min(lease.locked_chunks, len(sizes) // height)
        for c in range(columns):
            for r in range(height):
                size = sizes[c * height + r]
                want = row_nbytes[r] if row_nbytes is not None else None
                if not 0 < size <= self.max_object_bytes or (want is not None and size != want):
                    logger.warning("P2P: peer announced chunk size %d (want %s)", size, want)
                    transfer.problem = f"announced chunk size {size} (want {want})"
                    columns = c
                    break
            else:
                continue
            break
        transfer.sizes = sizes[: columns * height]
        transfer.received = [0] * len(transfer.sizes)
        return columns

    def _stage(self, transfer: Transfer, columns: int) -> int:
        """Reserve an L1 object per cell; a cell already resident here is used as is."""
        cells = [(r, c) for c in range(columns) for r in range(transfer.height)]
        if not cells:
            return 0
        results, objects = self.l1.reserve_write(
            [transfer.key(cell) for cell in cells],
            [transfer.sizes[c * transfer.height + r] for r, c in cells],
            tag=transfer.tag,
        )
        for cell, res in zip(cells, results, strict=True):
            if res is L1Result.SUCCESS:
                transfer.staged[cell] = objects[transfer.key(cell)]
            elif res is L1Result.KEY_NOT_WRITABLE and self.l1.contains([transfer.key(cell)])[0]:
                transfer.local.add(cell)
            else:
                if cell[1] < columns:
                    transfer.problem = f"chunk {cell[1]} could not be staged here ({res.name})"
                columns = min(columns, cell[1])
        return columns

    def _receive(self, peer: PeerTarget, lease: PeerLease, t: Transfer, columns: int) -> int:
        """Stream the lease into the staged objects; the columns received whole, in order."""
        sink = TransferSink(
            peer,
            t,
            columns * t.height,
            closing=lambda: self.closing,
            on_received=self.count_received,
        )
        try:
            t.complete = self.link.read(peer, lease, sink, self.settings.load_timeout_s)
        except PeerUnavailable as exc:
            logger.info("P2P: stream from %s ended early: %s", peer.instance_id, exc)
            t.error = exc
            t.problem = t.problem or "the stream ended early"
        whole = 0
        for c in range(columns):
            cells = range(c * t.height, (c + 1) * t.height)
            if any(t.received[i] != t.sizes[i] for i in cells):
                break
            whole = c + 1
        return whole

    def _publish(self, t: Transfer, columns: int, readers: int) -> int:
        """Publish staged cells of the whole columns, lock local ones; the columns kept."""
        cells = [(r, c) for c in range(columns) for r in range(t.height)]
        staged = [cell for cell in cells if cell in t.staged]
        local = [cell for cell in cells if cell in t.local]
        ok: dict[Cell, bool] = {}
        if staged:
            results = self.l1.finish_write_and_reserve_read(
                [t.key(c) for c in staged], readers, tag=t.tag
            )
            for cell, res in zip(staged, results, strict=True):
                ok[cell] = res is L1Result.SUCCESS
                del t.staged[cell]
        if local:
            results = self.l1.reserve_read([t.key(c) for c in local], readers)
            for cell, res in zip(local, results, strict=True):
                ok[cell] = res is L1Result.SUCCESS
        kept = columns
        for r, c in cells:
            if not ok.get((r, c), False):
                kept = min(kept, c)
        late = [t.key(cell) for cell in cells if cell[1] >= kept and ok.get(cell, False)]
        if late:
            self.l1.finish_read(late, readers)
        return kept

    def _discard(self, t: Transfer) -> None:
        if t.staged:
            self.l1.finish_write_and_delete([t.key(c) for c in t.staged], tag=t.tag)
            t.staged.clear()

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closing.is_set()

    def count_received(self, nbytes: int) -> None:
        """Count bytes of a stream as they arrive (the ``received_bytes`` counter)."""
        with self._lock:
            self._counters.received_bytes += nbytes

    def _count(self, *, failure: bool = False, miss: bool = False) -> None:
        with self._lock:
            if failure:
                self._counters.fetch_failures += 1
            if miss:
                self._counters.misses += 1


def _failed(span: Any, message: str, exc: Exception | None = None) -> None:
    """Mark a fetch's span failed (ERROR status, the exception as an event)."""
    span.set_attribute("kvmesh.p2p.outcome", "failed")
    if exc is not None:
        span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, message))


def _left(deadline: float) -> float:
    """Seconds to ``deadline`` (at least a millisecond, so a call fails fast, not never)."""
    return max(0.001, deadline - time.monotonic())
