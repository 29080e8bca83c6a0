"""When the coordinator asks a node to resync: the one place that decides it.

A resync (``ResyncCommand``, one for L1 and one for L2) makes a node
re-announce every placement it holds as STORE events: its resident L1
objects and each L2 adapter's index. The directory is complete for a live
node exactly when it has applied every batch of the node's current
incarnation and discarded none of the node's placements while the node
kept them. So a resync is needed whenever the coordinator's view of a
*live* node's stream has a hole, and the triggers are:

1. **A gap** — a batch admitted with ``seq > last_seq + 1`` (the gate's
   gap), including the first batch on a fresh cursor with ``seq > 1``.
   Batches of this incarnation were never applied: the coordinator started
   cold, or was restored from an older checkpoint, or forgot the node's
   cursor (see 2), or the node dropped batches when its delivery window
   overflowed. Resync both tiers. A gap inside an incarnation (the cursor
   survived) is rate-limited to one resync per node per ``min_interval``
   (later gaps meanwhile are folded into one more resync when the interval
   is over), so a node whose window keeps overflowing is not asked to
   re-announce everything at every batch; a gap on a fresh cursor is acted
   on at once.
2. **A node dropped while it lives on** — heartbeat expiry (a paused or
   partitioned process) or an operator's DeregisterInstance fences the
   node's L1 placements and forgets its cursor, although the process still
   holds them. No separate trigger is needed: forgetting the cursor turns
   the node's next batch into a fresh cursor with ``seq > 1``, i.e. trigger
   1 (only a node that never sent a batch has ``seq 1`` next, and it has
   nothing to fence). And a dropped node that lives on always sends a next
   batch: its heartbeat answers NOT_FOUND, it registers again, and every
   (re-)registration re-declares its capacity (a CONFIG batch). A drop also
   cancels what :meth:`ResyncPlanner.stream_opened` marked (below), so the
   resync that follows the drop is never skipped.
3. **An emitter the coordinator has no cursor for opens its stream** —
   resync at once (prior behaviour; the NATS source does the same for the
   first batch it sees of an unknown emitter). Not needed for
   correctness, since trigger 1 fires at the node's next batch, but it
   makes an idle node's placements come back promptly after a cold start.
   The first batch on that fresh cursor is then not a second trigger.

Why nothing else needs one: a new incarnation fences the old one's L1, but
that L1 died with the old process; the new process announces its L2 index
at start and its L1 is empty (its own lost first batches are trigger 1).
The directory changes a node's placements only through admitted batches,
fences (restart, drop) and nothing else, so every way for it to miss a
live node's placements is a batch not applied or a fence of a live node —
the two cases above.

What a resync cannot do: it re-announces, it never retracts. After an
in-incarnation gap, a lost DELETE leaves a stale placement until the key is
deleted or evicted again (a node reports a DELETE for every key it is asked
to delete, held or not). After a drop there is nothing stale: the fence
removed every L1 placement first, and L2 placements change only through
events, none of which were lost (the node resends what was not acked).

Unsent resyncs (no dispatcher, the node's stream closed in between) are
retried by :meth:`ResyncPlanner.tick` (the coordinator's resync timer).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

DEFAULT_MIN_INTERVAL = 30.0


@runtime_checkable
class ResyncDispatcher(Protocol):
    """Sends a resync (both tiers) to one node; True when it was accepted for delivery."""

    def dispatch_resync(self, instance_id: str) -> bool:
        """Ask ``instance_id`` to re-announce everything it holds; must not block for long."""
        ...


@dataclass(frozen=True, slots=True)
class ResyncStats:
    """Resyncs requested and held back since start, and those still to send."""

    requested: int
    held_back: int
    pending: int


class ResyncPlanner:
    """Decides and sends resync requests (module docstring); thread-safe."""

    def __init__(
        self,
        *,
        dispatcher: ResyncDispatcher | None = None,
        min_interval: float = DEFAULT_MIN_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dispatcher = dispatcher
        self._min_interval = min_interval
        self._clock = clock
        self._lock = threading.Lock()
        # Instance → when its last resync was sent.
        self._last: dict[str, float] = {}
        # Instance → (why a resync is still owed, held back by the interval; else undelivered).
        self._pending: dict[str, tuple[str, bool]] = {}
        # Instances asked to resync when their stream opened without a cursor: the
        # first batch on their fresh cursor is covered by that request.
        self._covered: set[str] = set()
        self._requested = 0
        self._held_back = 0

    # -- triggers ------------------------------------------------------------------

    def cursor_event(self, instance_id: str, fresh: bool, gap: bool) -> None:
        """The gate admitted a batch that started a fresh cursor and/or skipped seqs."""
        with self._lock:
            covered = fresh and instance_id in self._covered
            if fresh:
                self._covered.discard(instance_id)
        if gap and not covered:
            why = "its first batch on a fresh cursor skips seqs" if fresh else "a seq gap"
            self.request(instance_id, why, limited=not fresh)

    def stream_opened(self, instance_id: str, *, known: bool) -> bool:
        """A node opened its event stream; ``known``: the gate has a cursor for it."""
        if known:
            return False
        return self.request(instance_id, "an unknown emitter opened its stream", cover=True)

    def note_requested(self, instance_id: str) -> None:
        """Another component asked ``instance_id`` for a resync of an unknown emitter itself."""
        with self._lock:
            self._covered.add(instance_id)
            self._last[instance_id] = self._clock()
            self._pending.pop(instance_id, None)
            self._requested += 1

    def instance_dropped(self, instance_id: str) -> None:
        """The node was fenced and its cursor forgotten (heartbeat expiry, deregistration)."""
        with self._lock:
            self._covered.discard(instance_id)
            # Its next batch is a fresh-cursor gap, which asks again.
            self._pending.pop(instance_id, None)

    # -- sending -------------------------------------------------------------------

    def request(
        self,
        instance_id: str,
        why: str,
        *,
        limited: bool = False,
        cover: bool = False,
        retry: bool = False,
    ) -> bool:
        """Send a resync now (``limited``: unless one went out within ``min_interval``).

        Returns True when it was sent; otherwise it is owed and :meth:`tick`
        sends it (a held-back one once the interval is over, an undeliverable
        one at the next tick).
        """
        now = self._clock()
        with self._lock:
            last = self._last.get(instance_id)
            if limited and last is not None and now - last < self._min_interval:
                if instance_id not in self._pending:
                    self._pending[instance_id] = (why, True)
                self._held_back += 1
                return False
            dispatcher = self.dispatcher
            if dispatcher is None:
                return False
            self._last[instance_id] = now
            self._pending.pop(instance_id, None)
        try:
            sent = bool(dispatcher.dispatch_resync(instance_id))
        except Exception:
            logger.exception("sending a resync to %s failed", instance_id)
            sent = False
        with self._lock:
            if sent:
                self._requested += 1
                if cover:
                    self._covered.add(instance_id)
            else:
                if last is None:
                    self._last.pop(instance_id, None)
                else:
                    self._last[instance_id] = last
                self._pending[instance_id] = (why, False)
        if sent:
            logger.info("asked %s to resync: %s", instance_id, why)
        else:
            log = logger.debug if retry else logger.warning
            log("could not ask %s to resync (%s); will retry", instance_id, why)
        return sent

    def tick(self) -> int:
        """Send the resyncs still owed that are due; returns how many were sent."""
        now = self._clock()
        with self._lock:
            due = [
                (iid, why)
                for iid, (why, held_back) in self._pending.items()
                if not held_back or now - self._last.get(iid, float("-inf")) >= self._min_interval
            ]
        return sum(1 for iid, why in due if self.request(iid, why, retry=True))

    def stats(self) -> ResyncStats:
        """Counters."""
        with self._lock:
            return ResyncStats(self._requested, self._held_back, len(self._pending))
