"""The storage node's cache-event emitter: every placement change, reported in order, once.

What it does (docs/events.md, "Emitter: batching and numbering" and "Delivery";
LMCache's emitter with kvmesh's changes):

* ``record`` / ``record_capacity`` are called from many threads (L1 manager,
  store and prefetch controllers). They only append to a pending list under
  a short lock; nothing on those threads touches the network.
* Pending entries merge into the *last* pending batch when its identity
  ``(event_type, tier, backend, shared)`` matches and it has room, never into
  an earlier one, so store → delete → store of one key stays three batches.
  A batch holds at most ``max_entries_per_batch`` entries. A pending capacity
  snapshot replaces an older unflushed one and is flushed first, as one
  CONFIG batch per compartment sharing one ``capacity_revision``.
* A flusher thread turns pending batches into numbered batches every
  ``flush_interval_s`` (and at once when a batch fills). ``seq`` starts at 1
  per incarnation, is assigned at flush, consecutive, never reused.
* Numbered batches go to :class:`~kvmesh.storage.events.delivery.EventDelivery`:
  a bounded window, at-least-once delivery through an
  :class:`~kvmesh.storage.events.transport.EventTransport` with reconnects
  and resends, and the oldest batches dropped (a gap the coordinator sees)
  when the window overflows. (LMCache drops a batch whose publish failed.)

The coordinator's commands to this node (delete keys, quota changed, resync)
travel down the same stream; each transport runs them through a
:class:`~kvmesh.storage.events.commands.CommandExecutor` into
:meth:`CacheEventEmitter.execute_command`. Their effects come back as
ordinary cache events recorded through this emitter.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import (
    UNKNOWN_TOKEN_OFFSET,
    CacheEventBatch,
    CacheEventEntry,
    EventType,
    Tier,
)
from kvmesh.common.keys import validate_object_key
from kvmesh.common.telemetry import current_traceparent
from kvmesh.storage.core.ports import CommandHandler, NodeCommand
from kvmesh.storage.events.commands import run_handler
from kvmesh.storage.events.config import EmitterConfig, EmitterStats, ModuleCapacity
from kvmesh.storage.events.delivery import EventDelivery
from kvmesh.storage.events.transport import CommandResult, EventTransport

logger = logging.getLogger(__name__)

__all__ = ["CacheEventEmitter"]

_PLACEMENT_EVENT_TYPES = frozenset({EventType.STORE, EventType.DELETE, EventType.ACCESS})
_UINT32_LIMIT = 1 << 32


class _PendingBatch:
    """Entries waiting for a flush; mutable so records can merge into it cheaply."""

    __slots__ = ("backend", "entries", "event_type", "shared", "tier", "traceparent")

    def __init__(
        self, event_type: EventType, tier: Tier, backend: str, shared: bool, traceparent: str
    ) -> None:
        self.event_type = event_type
        self.tier = tier
        self.backend = backend
        self.shared = shared
        self.entries: list[CacheEventEntry] = []
        # The trace of every change in the batch (records of another trace start a
        # new batch), so the coordinator's ingest joins that request's trace.
        self.traceparent = traceparent


class CacheEventEmitter:
    """Buffers, numbers and delivers one storage node's cache events (module docstring).

    Construct, then :meth:`start` the flusher and sender threads; without
    ``start`` nothing is sent and :meth:`flush` moves pending events into the
    window by hand (what the batching tests use). ``wall_clock`` stamps
    ``ts`` (one value per flush); ``rng`` drives reconnect jitter. Timers and
    deadlines use ``time.monotonic`` because they bound real waits.
    """

    def __init__(
        self,
        config: EmitterConfig,
        transport: EventTransport,
        *,
        command_handler: CommandHandler | None = None,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._command_handler = command_handler
        self._clock = time.monotonic
        self._wall_clock = wall_clock
        self._delivery = EventDelivery(
            config, transport, self.execute_command, rng or random.Random()
        )

        # Recording side, guarded by _lock (held only for list appends).
        self._lock = threading.Lock()
        self._pending: list[_PendingBatch] = []
        self._pending_entries = 0
        self._pending_capacity: tuple[ModuleCapacity, ...] | None = None
        self._closed = False
        self._records_ignored_empty = 0
        self._records_after_close = 0
        self._warned_after_close = False
        self._commands_handled = 0
        self._commands_failed = 0

        # Serialises flushes so seq order equals window order.
        self._flush_lock = threading.Lock()
        self._capacity_revision = 0
        self._declared_capacity: tuple[ModuleCapacity, ...] = ()

        self._wake_flusher = threading.Event()
        self._stop_flusher = threading.Event()
        self._flusher: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle

    @property
    def config(self) -> EmitterConfig:
        """The settings this emitter runs with."""
        return self._config

    def start(self) -> None:
        """Start the flusher and sender threads (idempotent)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("emitter is closed")
            if self._flusher is not None:
                return
            self._flusher = threading.Thread(
                target=self._run_flusher,
                name=f"event-flusher-{self._config.instance_id}",
                daemon=True,
            )
        self._flusher.start()
        self._delivery.start()

    def close(self, timeout: float = 5.0) -> bool:
        """Flush, wait up to ``timeout`` s for every batch to be acked, stop the threads.

        Returns True when nothing was left unacked. Records arriving after
        ``close`` began are counted and discarded. Idempotent.
        """
        deadline = self._clock() + max(0.0, timeout)
        with self._lock:
            already = self._closed
            self._closed = True
        if already:
            return self._delivery.window_empty()
        self._stop_flusher.set()
        self._wake_flusher.set()
        if self._flusher is not None:
            self._flusher.join(max(0.0, deadline - self._clock()))
        self.flush()
        return self._delivery.close(deadline)

    # ----------------------------------------------------------------- recording

    def record(
        self,
        event_type: EventType,
        tier: Tier,
        backend: str,
        shared: bool,
        entries: Sequence[CacheEventEntry],
    ) -> None:
        """Queue a STORE, DELETE or ACCESS of ``entries`` (thread-safe, never blocks on I/O).

        An empty ``entries`` is ignored. Raises InvalidArgument for a CONFIG
        event (use :meth:`record_capacity`), a tier other than L1/L2, an empty
        backend on STORE/DELETE, or an invalid entry — a bad batch would
        otherwise be rejected by the coordinator and resent forever. The
        caller must not mutate the entries' ``token_ids`` afterwards.
        """
        if not entries:
            with self._lock:
                self._records_ignored_empty += 1
            return
        _check_record(event_type, tier, backend, entries)
        cap = self._config.max_entries_per_batch
        wake = False
        with self._lock:
            if self._closed:
                self._note_record_after_close()
                return
            start = 0
            last = self._pending[-1] if self._pending else None
            traceparent = current_traceparent()
            if (
                last is not None
                and last.event_type == event_type
                and last.tier == tier
                and last.backend == backend
                and last.shared == shared
                and last.traceparent == traceparent  # a batch belongs to one trace
                and len(last.entries) < cap
            ):
                start = cap - len(last.entries)
                last.entries.extend(entries[:start])
                wake = len(last.entries) >= cap
            for offset in range(start, len(entries), cap):
                batch = _PendingBatch(
                    EventType(event_type), Tier(tier), backend, shared, traceparent
                )
                batch.entries.extend(entries[offset : offset + cap])
                self._pending.append(batch)
                wake = wake or len(batch.entries) >= cap
            self._pending_entries += len(entries)
        if wake or self._config.flush_interval_s == 0.0:
            self._wake_flusher.set()

    def record_capacity(self, modules: Iterable[tuple[Tier, str, bool, int]]) -> None:
        """Declare the node's whole capacity topology: ``(tier, backend, shared, bytes)`` each.

        Replaces an unflushed older declaration. At the next flush it becomes
        one CONFIG batch per module, all with the next ``capacity_revision``,
        ahead of the placement batches of that flush.
        """
        snapshot = tuple(ModuleCapacity(Tier(t), b, bool(s), int(c)) for t, b, s, c in modules)
        for i, module in enumerate(snapshot):
            if not module.backend:
                raise InvalidArgument("a capacity module needs a backend", field=f"modules[{i}]")
            if module.capacity_bytes < 0:
                raise InvalidArgument(
                    "capacity_bytes must be >= 0", field=f"modules[{i}].capacity_bytes"
                )
        with self._lock:
            if self._closed:
                self._note_record_after_close()
                return
            self._pending_capacity = snapshot
        if self._config.flush_interval_s == 0.0:
            self._wake_flusher.set()

    def redeclare_capacity(self) -> None:
        """Queue the last declared capacity again, at a new revision.

        For the registrar's ``on_registered`` after the coordinator forgot
        this node. No-op when nothing was declared or a newer one is pending.
        """
        with self._flush_lock:
            declared = self._declared_capacity
        if not declared:
            return
        with self._lock:
            if self._pending_capacity is None and not self._closed:
                self._pending_capacity = declared
        if self._config.flush_interval_s == 0.0:
            self._wake_flusher.set()

    def _note_record_after_close(self) -> None:
        self._records_after_close += 1
        if not self._warned_after_close:
            self._warned_after_close = True
            logger.warning("cache events recorded after the emitter closed are discarded")

    # ----------------------------------------------------------------- flushing

    # ----------------------------------------------------------------- flushing

    def flush(self) -> int:
        """Number the pending events and move them into the delivery window now.

        Returns the number of batches created (0 when nothing was pending:
        an empty flush publishes nothing and consumes no seq).
        """
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, []
                capacity, self._pending_capacity = self._pending_capacity, None
                self._pending_entries = 0
            count = len(pending) + (len(capacity) if capacity else 0)
            if count == 0:
                return 0
            ts = self._wall_clock()
            first_seq = self._delivery.reserve(count)
            cfg = self._config
            batches: list[CacheEventBatch] = []
            seq = first_seq
            if capacity:
                self._capacity_revision += 1
                self._declared_capacity = capacity
                for module in capacity:
                    batches.append(
                        CacheEventBatch(
                            instance_id=cfg.instance_id,
                            incarnation=cfg.incarnation,
                            seq=seq,
                            event_type=EventType.CONFIG,
                            tier=module.tier,
                            backend=module.backend,
                            shared=module.shared,
                            ts=ts,
                            capacity_bytes=module.capacity_bytes,
                            capacity_revision=self._capacity_revision,
                        )
                    )
                    seq += 1
            for p in pending:
                batches.append(
                    CacheEventBatch(
                        instance_id=cfg.instance_id,
                        incarnation=cfg.incarnation,
                        seq=seq,
                        event_type=p.event_type,
                        tier=p.tier,
                        backend=p.backend,
                        shared=p.shared,
                        ts=ts,
                        entries=tuple(p.entries),
                        traceparent=p.traceparent,
                    )
                )
                seq += 1
            revision = self._capacity_revision
            dropped = self._delivery.append(batches)
        if dropped:
            self._delivery.note_overflow(dropped)
            # A lost declaration would leave the coordinator without our capacity;
            # queue it again (at a new revision) unless a newer one is pending.
            if any(
                b.event_type is EventType.CONFIG and b.capacity_revision == revision
                for b in dropped
            ):
                self.redeclare_capacity()
        return count

    def _run_flusher(self) -> None:
        interval = self._config.flush_interval_s
        next_due = self._clock() + interval
        while not self._stop_flusher.is_set():
            # interval 0: every record wakes us, so no timer is needed.
            timeout = None if interval == 0.0 else max(0.0, next_due - self._clock())
            self._wake_flusher.wait(timeout)
            # Cleared before flushing so a record arriving mid-flush wakes us again.
            self._wake_flusher.clear()
            if self._stop_flusher.is_set():
                return
            try:
                self.flush()
            except Exception:
                logger.exception("event flush failed")
            now = self._clock()
            if now >= next_due:
                next_due = now + interval

    # ----------------------------------------------------------------- delivery

    # ----------------------------------------------------------------- delivery

    def wait_until_acked(self, seq: int, timeout: float | None = None) -> bool:
        """Block until every batch up to ``seq`` is acked or dropped; False on timeout."""
        return self._delivery.wait_until_acked(seq, timeout)

    def wait_until_drained(self, timeout: float | None = None) -> bool:
        """Block until every flushed batch is acked or dropped; False on timeout."""
        return self._delivery.wait_until_drained(timeout)

    # ----------------------------------------------------------------- commands

    def execute_command(self, command: NodeCommand) -> CommandResult:
        """Run ``command`` through the node's handler and describe the outcome; never raises.

        Events the handler recorded are flushed before returning, so
        ``effects_through_seq`` covers them.
        """
        code, message, affected = run_handler(self._command_handler, command)
        self.flush()
        through = self._delivery.last_seq
        with self._lock:
            self._commands_handled += 1
            if code != "OK":
                self._commands_failed += 1
        return CommandResult(
            command_id=command.command_id,
            code=code,
            message=message,
            affected=affected,
            effects_through_seq=through,
        )

    # ----------------------------------------------------------------- inspection

    @property
    def last_seq(self) -> int:
        """Highest seq assigned so far (0 before the first flush)."""
        return self._delivery.last_seq

    def unacked_batches(self) -> list[CacheEventBatch]:
        """The flushed batches not yet acked, oldest first (a copy)."""
        return self._delivery.unacked_batches()

    def stats(self) -> EmitterStats:
        """A consistent-enough snapshot of every counter."""
        with self._lock:
            pending_batches = len(self._pending)
            pending_entries = self._pending_entries
            ignored = self._records_ignored_empty
            after_close = self._records_after_close
            handled = self._commands_handled
            failed = self._commands_failed
        d = self._delivery.stats()
        return EmitterStats(
            instance_id=self._config.instance_id,
            incarnation=self._config.incarnation,
            last_seq=d.last_seq,
            acked_through_seq=d.acked_through_seq,
            pending_batches=pending_batches,
            pending_entries=pending_entries,
            records_ignored_empty=ignored,
            records_after_close=after_close,
            batches_flushed=d.batches_flushed,
            batches_sent=d.batches_sent,
            batches_resent=d.batches_resent,
            batches_acked=d.batches_acked,
            batches_dropped=d.batches_dropped,
            acks_admitted=d.acks_admitted,
            acks_duplicate=d.acks_duplicate,
            acks_stale=d.acks_stale,
            window_depth=d.window_depth,
            window_bytes=d.window_bytes,
            connected=d.connected,
            sessions_opened=d.sessions_opened,
            reconnects=max(0, d.sessions_opened - 1),
            connect_failures=d.connect_failures,
            disconnects=d.disconnects,
            capacity_revision=self._capacity_revision,
            commands_handled=handled,
            commands_failed=failed,
            last_error=d.last_error,
        )


def _check_record(
    event_type: EventType, tier: Tier, backend: str, entries: Sequence[CacheEventEntry]
) -> None:
    if event_type not in _PLACEMENT_EVENT_TYPES:
        raise InvalidArgument(
            f"record() takes STORE, DELETE or ACCESS, got {event_type!r}; "
            "capacity goes through record_capacity()",
            field="event_type",
        )
    if tier not in (Tier.L1, Tier.L2):
        raise InvalidArgument(f"tier must be L1 or L2, got {tier!r}", field="tier")
    if not backend and event_type != EventType.ACCESS:
        raise InvalidArgument(
            f"backend must not be empty for {EventType(event_type).name}", field="backend"
        )
    for i, entry in enumerate(entries):
        validate_object_key(entry.key, field=f"entries[{i}].key")
        if entry.size_bytes < 0:
            raise InvalidArgument("size_bytes must be >= 0", field=f"entries[{i}].size_bytes")
        if entry.token_offset < UNKNOWN_TOKEN_OFFSET:
            raise InvalidArgument(
                "token_offset must be >= 0 or -1", field=f"entries[{i}].token_offset"
            )
        if entry.token_ids and not all(0 <= t < _UINT32_LIMIT for t in entry.token_ids):
            raise InvalidArgument("token_ids must fit in 32 bits", field=f"entries[{i}].token_ids")
