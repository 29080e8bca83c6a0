"""Admission of cache-event batches: incarnation fencing, seq dedup, gap detection.

Behaviour is LMCache 0.5.6's EventGate exactly (docs/coordinator.md, "Event gate"):

* a batch from an older incarnation than the emitter's cursor is
  STALE_INCARNATION and nothing else happens;
* a newer incarnation first fences the emitter in every consumer (its L1
  state is void), then gets a fresh cursor with ``last_seq = 0``;
* within one incarnation ``seq <= last_seq`` is a DUPLICATE (no reorder
  buffer: once seq 5 is in, seq 3 is dropped);
* a jump ``seq > last_seq + 1`` sets the sticky ``gap_detected`` flag but the
  batch is still admitted (consumers apply idempotently);
* ``drop_instance`` fences and forgets the cursor, so any incarnation,
  even a lower one, starts fresh afterwards; ``drop_if_quiet`` does the
  same for an emitter not heard from for a while (kvmesh: the coordinator
  sweeps unregistered ids with it, docs/coordinator.md, "Membership").

Lock order: ``QuiesceLock.applying()`` outside, the gate lock inside, then
the consumers' own locks. The gate lock is held through the fan-out so one
emitter's batches reach consumers in admission order; consumers must never
call back into the gate.

kvmesh additions: per-emitter counters (admitted / duplicate / stale,
incarnation changes, last admit time) in :meth:`EventGate.cursors`, which the
directory servicer exposes over gRPC (LMCache has no endpoint for cursors
or gap flags); and ``on_cursor``, told after the locks are released about
every admitted batch that started a fresh cursor or skipped seqs (every
gap, not only the first that sets the sticky flag), so the coordinator can
act on it (:mod:`.resync`). The QuiesceLock itself lives in :mod:`.quiesce` (persistence
needs it too, and must not import the gate).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvmesh.common.events import CacheEventBatch, IngestResult

from .persistence import PersistenceType
from .quiesce import QuiesceLock
from .types import CursorInfo, IngestSummary

logger = logging.getLogger(__name__)


class BatchFanout(Protocol):
    """What the gate hands admitted batches and fences to (the broadcaster)."""

    def broadcast(self, batch: CacheEventBatch) -> None:
        """Deliver one admitted batch to every consumer."""

    def fence_instance(self, instance_id: str) -> None:
        """Make every consumer drop the L1 state ``instance_id`` reported."""


@dataclass(slots=True)
class Cursor:
    """Stream position of one emitter plus its admission counters."""

    incarnation: int
    last_seq: int = 0
    gap_detected: bool = False
    admitted: int = 0
    duplicate: int = 0
    stale: int = 0
    incarnation_changes: int = 0
    last_admit_time: float = 0.0
    #: Monotonic time of the last batch admitted or dropped as a duplicate (or of
    #: the restore, for a restored cursor): what :meth:`EventGate.drop_if_quiet`
    #: reads. Not saved.
    heard: float = 0.0


CursorListener = Callable[[str, bool, bool], None]
"""``(instance_id, fresh, gap)`` of an admitted batch that started a cursor or skipped seqs."""


class EventGate:
    """The only way cache facts enter the coordinator (docs/coordinator.md, "Event gate")."""

    name = "stream_cursors"
    persistence_type = PersistenceType.CHECKPOINT

    def __init__(
        self,
        fanout: BatchFanout,
        quiesce: QuiesceLock | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        on_cursor: CursorListener | None = None,
    ) -> None:
        self._fanout = fanout
        self._clock = clock
        self.on_cursor = on_cursor
        self._quiesce = quiesce if quiesce is not None else QuiesceLock()
        self._lock = threading.Lock()
        self._cursors: dict[str, Cursor] = {}
        self._wall = wall_clock
        self._restored = False

    @property
    def quiesce(self) -> QuiesceLock:
        """The quiesce lock this gate brackets its batches with."""
        return self._quiesce

    def ingest(self, batch: CacheEventBatch) -> IngestResult:
        """Admit, drop as duplicate, or drop as stale one already-validated batch."""
        fresh = gap = False
        with self._quiesce.applying(), self._lock:
            iid = batch.instance_id
            c = self._cursors.get(iid)
            if c is not None:
                if batch.incarnation < c.incarnation:
                    c.stale += 1
                    return IngestResult.STALE_INCARNATION
                if batch.incarnation > c.incarnation:
                    # Restart: the old incarnation's L1 is void. Fence before
                    # anything of the new one is applied.
                    self._fanout.fence_instance(iid)
                    c = Cursor(
                        incarnation=batch.incarnation,
                        admitted=c.admitted,
                        duplicate=c.duplicate,
                        stale=c.stale,
                        incarnation_changes=c.incarnation_changes + 1,
                        last_admit_time=c.last_admit_time,
                    )
                    self._cursors[iid] = c
                    fresh = True
                elif batch.seq <= c.last_seq:
                    c.duplicate += 1
                    c.heard = self._clock()
                    return IngestResult.DUPLICATE
            else:
                c = Cursor(incarnation=batch.incarnation)
                self._cursors[iid] = c
                fresh = True
            if batch.seq > c.last_seq + 1:
                gap = True
                if not c.gap_detected:
                    c.gap_detected = True
                    logger.warning(
                        "Event stream gap from %s incarnation %d: last seq %d, got %d",
                        iid,
                        batch.incarnation,
                        c.last_seq,
                        batch.seq,
                    )
            c.last_seq = batch.seq
            c.admitted += 1
            c.last_admit_time = self._wall()
            c.heard = self._clock()
            self._fanout.broadcast(batch)
        listener = self.on_cursor
        if listener is not None and (fresh or gap):
            try:
                listener(iid, fresh, gap)
            except Exception:
                logger.exception("the cursor listener failed for %s", iid)
        return IngestResult.ADMITTED

    def ingest_batches(self, batches: Iterable[CacheEventBatch]) -> IngestSummary:
        """Ingest each batch in order and count the outcomes."""
        applied = duplicates = stale = 0
        for batch in batches:
            result = self.ingest(batch)
            if result is IngestResult.ADMITTED:
                applied += 1
            elif result is IngestResult.DUPLICATE:
                duplicates += 1
            elif result is IngestResult.STALE_INCARNATION:
                stale += 1
            else:  # pragma: no cover - the enum has no other member
                raise RuntimeError(f"unknown ingest result {result!r}")
        return IngestSummary(applied=applied, duplicates=duplicates, stale=stale)

    def drop_instance(self, instance_id: str) -> None:
        """Fence ``instance_id`` in every consumer and forget its cursor (fences even if none)."""
        with self._quiesce.applying(), self._lock:
            self._fanout.fence_instance(instance_id)
            self._cursors.pop(instance_id, None)

    def drop_if_quiet(self, instance_id: str, quiet_s: float, *, since: float) -> bool:
        """:meth:`drop_instance` unless ``instance_id`` was heard from in the last ``quiet_s``.

        Heard from: a batch admitted or dropped as a duplicate; a restored
        cursor counts as heard at its restore. An id without a cursor counts
        from ``since`` (a monotonic time, the caller's start). Checked and
        dropped under the gate lock, so a batch cannot land in between.
        True when it was dropped.
        """
        with self._quiesce.applying(), self._lock:
            if not self._quiet(instance_id, quiet_s, since):
                return False
            self._fanout.fence_instance(instance_id)
            self._cursors.pop(instance_id, None)
            return True

    def hear_all(self) -> None:
        """Count every cursor as heard from now (the coordinator starts serving)."""
        now = self._clock()
        with self._lock:
            for c in self._cursors.values():
                c.heard = max(c.heard, now)

    def is_quiet(self, instance_id: str, quiet_s: float, *, since: float) -> bool:
        """Whether :meth:`drop_if_quiet` would drop ``instance_id`` now."""
        with self._lock:
            return self._quiet(instance_id, quiet_s, since)

    def _quiet(self, instance_id: str, quiet_s: float, since: float) -> bool:
        c = self._cursors.get(instance_id)
        heard = c.heard if c is not None else since
        return self._clock() - heard > quiet_s

    def has_cursor(self, instance_id: str) -> bool:
        """True when the gate holds a cursor for ``instance_id``."""
        with self._lock:
            return instance_id in self._cursors

    def cursors(self) -> dict[str, CursorInfo]:
        """Snapshot of every emitter's cursor and counters."""
        with self._lock:
            return {
                iid: CursorInfo(
                    instance_id=iid,
                    incarnation=c.incarnation,
                    last_seq=c.last_seq,
                    gap_detected=c.gap_detected,
                    batches_admitted=c.admitted,
                    batches_duplicate=c.duplicate,
                    batches_stale=c.stale,
                    incarnation_changes=c.incarnation_changes,
                    last_admit_time=c.last_admit_time,
                )
                for iid, c in self._cursors.items()
            }

    # -- durable component -------------------------------------------------

    def capture(self) -> dict[str, object]:
        """``{"cursors": {id: [incarnation, last_seq, gap, admitted, dup, stale, changes, t]}}``."""
        with self._lock:
            return {
                "cursors": {
                    iid: [
                        c.incarnation,
                        c.last_seq,
                        c.gap_detected,
                        c.admitted,
                        c.duplicate,
                        c.stale,
                        c.incarnation_changes,
                        c.last_admit_time,
                    ]
                    for iid, c in self._cursors.items()
                }
            }

    def restore(self, state: object) -> None:
        """Load cursors into a gate that has admitted nothing yet.

        Only the first three fields are required, so LMCache-shaped
        ``(incarnation, last_seq, gap_detected)`` rows load too.
        """
        if not isinstance(state, Mapping):
            raise TypeError("stream_cursors state must be a mapping")
        rows = state.get("cursors")
        if not isinstance(rows, Mapping):
            raise TypeError("stream_cursors state has no 'cursors' mapping")
        loaded: dict[str, Cursor] = {}
        now = self._clock()
        for iid, row in rows.items():
            if not isinstance(iid, str) or not isinstance(row, list | tuple) or len(row) < 3:
                raise ValueError(f"malformed cursor row for {iid!r}")
            inc, last_seq, gap = row[0], row[1], row[2]
            if not isinstance(inc, int) or not isinstance(last_seq, int) or inc < 0 or last_seq < 0:
                raise ValueError(f"malformed cursor row for {iid!r}")
            extra = [int(x) for x in row[3:7]] + [0] * (4 - len(row[3:7]))
            loaded[iid] = Cursor(
                incarnation=inc,
                last_seq=last_seq,
                gap_detected=bool(gap),
                admitted=extra[0],
                duplicate=extra[1],
                stale=extra[2],
                incarnation_changes=extra[3],
                last_admit_time=float(row[7]) if len(row) > 7 else 0.0,
                heard=now,
            )
        with self._lock:
            if self._cursors or self._restored:
                raise ValueError(
                    "stream_cursors restore requires an empty gate "
                    "(a batch was admitted before restore, or it was restored already)"
                )
            self._cursors = loaded
            self._restored = True
