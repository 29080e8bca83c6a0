"""The storage node's cache-event emitter: every placement change, reported in order, once.

What it does (reference coordinator §6.4, with kvmesh's changes):

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
* Delivery is at-least-once: flushed batches wait in a bounded window until
  the coordinator acks them (admitted, duplicate and stale all count as
  delivered). A sender thread streams them in seq order through an
  :class:`EventTransport`; when the stream breaks it reconnects with jittered
  exponential backoff and resends every unacked batch. The gate drops
  ``seq <= last_seq``, so at-least-once plus dedup is exactly once in the
  directory. (LMCache drops a batch whose publish failed.)
* When the window overflows, the *oldest* unacked batches are dropped; their
  seqs stay consumed, so the coordinator's gate flags the gap instead of
  silently missing events.

The coordinator's commands to this node (delete keys, quota changed, resync)
travel down the same stream; see :class:`SessionListener`. Their effects come
back as ordinary cache events recorded through this emitter.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from kvmesh.common.errors import InvalidArgument, KvmeshError, Unavailable
from kvmesh.common.events import (
    UNKNOWN_TOKEN_OFFSET,
    CacheEventBatch,
    CacheEventEntry,
    EventType,
    IngestResult,
    Tier,
)
from kvmesh.common.keys import ObjectKey, validate_object_key
from kvmesh.common.telemetry import current_traceparent

logger = logging.getLogger(__name__)

#: Batches sent and not yet acked per stream, by default. Two keep a batch
#: travelling while the coordinator applies the previous one, and when both
#: acks come back together the link sends the next two as one batch group,
#: halving gRPC's per-message cost on both ends (on the coordinator about as
#: much as applying a 64-entry batch). A larger window queues more per node
#: in front of the coordinator, which every batch's ack waits behind (it adds
#: latency, Little's law), and lets one catching-up node crowd out the rest.
#: ``kvmesh bench ingest`` runs this window by default (DESIGN §7).
DEFAULT_MAX_IN_FLIGHT_BATCHES = 2

_PLACEMENT_EVENT_TYPES = frozenset({EventType.STORE, EventType.DELETE, EventType.ACCESS})


# --------------------------------------------------------------------------------------
# Transport contract
# --------------------------------------------------------------------------------------


class TransportError(Unavailable):
    """The event stream could not be opened, or broke; the emitter reconnects and resends."""

    default_reason = "EVENT_TRANSPORT_UNAVAILABLE"


@dataclass(frozen=True, slots=True)
class DeleteKeysCommand:
    """Delete these keys from one tier of this node (``backend`` "" = every adapter of it).

    Sent by the coordinator's fleet eviction controller (and operator deletes).
    The node answers with DELETE cache events for what it actually removed;
    keys it does not hold are not an error. ``force`` mirrors the contract's
    field of that name (delete even what the node would otherwise keep).
    """

    command_id: str
    tier: Tier
    backend: str
    keys: tuple[ObjectKey, ...]
    force: bool = False


@dataclass(frozen=True, slots=True)
class QuotaChangedCommand:
    """A per-``cache_salt`` byte quota for one tier changed (``quota_bytes`` None = removed).

    0 is a real quota: the salt may keep nothing on that tier.
    """

    command_id: str
    cache_salt: str
    tier: Tier
    quota_bytes: int | None


@dataclass(frozen=True, slots=True)
class ResyncCommand:
    """Re-announce every placement this node holds in ``tier`` as STORE events.

    Sent after a coordinator cold start (or a gap it cannot replay) so the
    directory learns the placements it lost — typically the L2 index, whose
    bytes outlive both processes.
    """

    command_id: str
    tier: Tier = Tier.L2


NodeCommand = DeleteKeysCommand | QuotaChangedCommand | ResyncCommand
"""A command the coordinator sends down a node's event stream."""


@dataclass(frozen=True, slots=True)
class CommandResult:
    """The node's answer to one :data:`NodeCommand`, written back up the same stream.

    ``code`` is a ``grpc.StatusCode`` name ("OK", "INVALID_ARGUMENT",
    "UNAVAILABLE", "UNIMPLEMENTED", "INTERNAL", ...), the same names as
    :attr:`kvmesh.common.errors.KvmeshError.code`. ``affected`` counts keys
    deleted or announced. Every cache event the handler recorded before it
    returned is in a batch with ``seq <= effects_through_seq``, so the
    coordinator knows the effects are applied once its cursor for this
    emitter reaches that seq.
    """

    command_id: str
    code: str = "OK"
    message: str = ""
    affected: int = 0
    effects_through_seq: int = 0

    @property
    def ok(self) -> bool:
        """True when the command succeeded."""
        return self.code == "OK"

    @property
    def error(self) -> str:
        """``"CODE: message"`` when the command failed, else "" (the wire's error text)."""
        return "" if self.ok else f"{self.code}: {self.message}"


@runtime_checkable
class CommandHandler(Protocol):
    """The storage node's side of coordinator commands.

    Called by the emitter (on the session's command thread, one command at a
    time, in arrival order); may block for a bounded time. Returns how many
    keys it affected; raises a :class:`KvmeshError` to report a failure with
    that error's status code. Effects are reported by recording cache events
    on the emitter, not in the return value.
    """

    def handle_command(self, command: NodeCommand) -> int:
        """Carry out ``command``; return the number of keys affected."""
        ...


class SessionListener(Protocol):
    """What an :class:`EventSession` calls back into (implemented by the emitter).

    Threading contract for a session implementation:

    * ``on_ack`` is called once per batch the coordinator answered, in stream
      order, from the session's reader thread. An ack for seq N also means
      every earlier seq of this incarnation was processed (the stream is
      ordered and the gate drops ``seq <= last_seq``).
    * ``on_command`` is called for each command, one at a time in arrival
      order, on a thread that does not deliver acks (a slow delete must not
      stall acks). It never raises; the session writes the returned
      :class:`CommandResult` upstream on the same stream (a ``oneof`` beside
      the batches in the gRPC request message).
    * ``on_closed`` is called once when the stream ends for any reason other
      than :meth:`EventSession.close` (``error`` None for a clean end).
    """

    def on_ack(self, seq: int, result: IngestResult) -> None:
        """The coordinator's gate answered the batch ``seq``."""
        ...

    def on_command(self, command: NodeCommand) -> CommandResult:
        """Execute a command sent down the stream and return its result."""
        ...

    def on_closed(self, error: BaseException | None) -> None:
        """The stream ended; the emitter will reconnect."""
        ...


class EventSession(Protocol):
    """One open event stream to the coordinator (e.g. one bidirectional gRPC call)."""

    def send(self, batch: CacheEventBatch) -> None:
        """Queue ``batch`` on the stream; quick, may block briefly for flow control.

        Only the emitter's sender thread calls it, in seq order. Raises
        :class:`TransportError` when the stream is broken. The session
        serialises this with its own writes of command results.
        """
        ...

    def close(self) -> None:
        """End the stream; idempotent, callable from any thread, unblocks a pending send."""
        ...


class EventTransport(Protocol):
    """Opens event sessions to the coordinator (the gRPC client plugs in here)."""

    def connect(
        self, instance_id: str, incarnation: int, listener: SessionListener
    ) -> EventSession:
        """Open a stream for this emitter; raise :class:`TransportError` on failure.

        ``instance_id``/``incarnation`` are sent when the stream opens (gRPC
        metadata or a first hello message) so the coordinator can route
        commands to this node before its first batch.
        """
        ...


# --------------------------------------------------------------------------------------
# Emitter
# --------------------------------------------------------------------------------------


class ModuleCapacity(NamedTuple):
    """Declared capacity of one compartment ``(tier, backend, shared)`` (0 = undeclared)."""

    tier: Tier
    backend: str
    shared: bool
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class EmitterConfig:
    """Settings of one :class:`CacheEventEmitter`.

    ``instance_id`` is stable across restarts (configured, or derived from
    host and port by the caller — never random per start); ``incarnation``
    comes from :func:`kvmesh.storage.core.incarnation.next_incarnation`.
    ``flush_interval_s`` 0 flushes after every record. The window holds at
    most ``max_buffered_batches`` unacked batches and about
    ``max_buffered_bytes`` (an estimate of their payload); beyond either the
    oldest are dropped. ``max_in_flight_batches`` bounds what is sent but not
    yet acked on one stream (see :data:`DEFAULT_MAX_IN_FLIGHT_BATCHES`); a
    stream with batches in flight and no ack for ``ack_timeout_s`` is
    treated as dead. Reconnects wait
    ``reconnect_base_s`` doubling up to ``reconnect_max_s``, each wait
    shortened by a random fraction up to ``reconnect_jitter``.
    """

    instance_id: str
    incarnation: int
    flush_interval_s: float = 0.05
    max_entries_per_batch: int = 1024
    max_buffered_batches: int = 65_536
    max_buffered_bytes: int = 256 * 1024 * 1024
    max_in_flight_batches: int = DEFAULT_MAX_IN_FLIGHT_BATCHES
    ack_timeout_s: float = 30.0
    reconnect_base_s: float = 0.05
    reconnect_max_s: float = 5.0
    reconnect_jitter: float = 0.2

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise InvalidArgument("instance_id must not be empty", field="instance_id")
        if self.incarnation < 0:
            raise InvalidArgument("incarnation must be >= 0", field="incarnation")
        if not self.flush_interval_s >= 0.0 or self.flush_interval_s == float("inf"):
            raise InvalidArgument(
                "flush_interval_s must be a finite value >= 0", field="flush_interval_s"
            )
        for name in ("max_entries_per_batch", "max_buffered_batches", "max_in_flight_batches"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1", field=name)
        if self.max_buffered_bytes < 1:
            raise InvalidArgument("max_buffered_bytes must be >= 1", field="max_buffered_bytes")
        if not self.ack_timeout_s > 0.0:
            raise InvalidArgument("ack_timeout_s must be > 0", field="ack_timeout_s")
        if not 0.0 < self.reconnect_base_s <= self.reconnect_max_s:
            raise InvalidArgument(
                "need 0 < reconnect_base_s <= reconnect_max_s", field="reconnect_base_s"
            )
        if not 0.0 <= self.reconnect_jitter <= 1.0:
            raise InvalidArgument("reconnect_jitter must be in [0, 1]", field="reconnect_jitter")


@dataclass(frozen=True, slots=True)
class EmitterStats:
    """A snapshot of the emitter's counters (for metrics and ``kvmesh status``)."""

    instance_id: str
    incarnation: int
    #: Highest seq assigned so far (0 before the first flush).
    last_seq: int
    #: Highest seq the coordinator acknowledged.
    acked_through_seq: int
    pending_batches: int
    pending_entries: int
    records_ignored_empty: int
    records_after_close: int
    batches_flushed: int
    batches_sent: int
    batches_resent: int
    batches_acked: int
    batches_dropped: int
    acks_admitted: int
    acks_duplicate: int
    acks_stale: int
    window_depth: int
    window_bytes: int
    connected: bool
    sessions_opened: int
    reconnects: int
    connect_failures: int
    disconnects: int
    capacity_revision: int
    commands_handled: int
    commands_failed: int
    last_error: str


class ReconnectBackoff:
    """Exponential reconnect delays: ``base_s``, doubling per attempt, capped at ``max_s``.

    Each delay is shortened by a random fraction up to ``jitter`` so a fleet
    of nodes does not reconnect in lockstep after a coordinator restart;
    never lengthened, so the nominal value is an upper bound.
    """

    def __init__(self, base_s: float, max_s: float, jitter: float, rng: random.Random) -> None:
        self._base = base_s
        self._max = max_s
        self._jitter = jitter
        self._rng = rng
        self._current = base_s

    def next_delay(self) -> float:
        """The delay before the next attempt; advances the schedule."""
        delay = self._current * (1.0 - self._jitter * self._rng.random())
        self._current = min(self._current * 2.0, self._max)
        return delay

    def reset(self) -> None:
        """Start again from ``base_s`` (after a healthy connection)."""
        self._current = self._base


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


class _Unacked(NamedTuple):
    batch: CacheEventBatch
    size_bytes: int


def _estimate_bytes(batch: CacheEventBatch) -> int:
    # Rough encoded size; only used to bound the window, so cheap beats exact.
    size = 96 + len(batch.backend)
    for entry in batch.entries:
        key = entry.key
        size += 72 + len(key.model_name) + len(key.cache_salt) + 8 * len(entry.token_ids)
    return size


class _Listener:
    """Per-session callbacks; the generation tells a stale session's close from the live one's."""

    __slots__ = ("_emitter", "_generation")

    def __init__(self, emitter: CacheEventEmitter, generation: int) -> None:
        self._emitter = emitter
        self._generation = generation

    def on_ack(self, seq: int, result: IngestResult) -> None:
        self._emitter._on_ack(self._generation, seq, result)

    def on_command(self, command: NodeCommand) -> CommandResult:
        return self._emitter.execute_command(command)

    def on_closed(self, error: BaseException | None) -> None:
        self._emitter._on_session_closed(self._generation, error)


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
        self._transport = transport
        self._command_handler = command_handler
        self._clock = time.monotonic
        self._wall_clock = wall_clock
        self._rng = rng or random.Random()

        # Recording side, guarded by _lock (held only for list appends).
        self._lock = threading.Lock()
        self._pending: list[_PendingBatch] = []
        self._pending_entries = 0
        self._pending_capacity: tuple[ModuleCapacity, ...] | None = None
        self._closed = False
        self._records_ignored_empty = 0
        self._records_after_close = 0
        self._warned_after_close = False

        # Serialises flushes so seq order equals window order.
        self._flush_lock = threading.Lock()
        self._capacity_revision = 0
        self._declared_capacity: tuple[ModuleCapacity, ...] = ()

        # Delivery side, guarded by _cond.
        self._cond = threading.Condition(threading.Lock())
        self._window: deque[_Unacked] = deque()
        self._window_bytes = 0
        self._next_seq = 1
        self._acked_through = 0
        self._next_send_seq = 1
        self._highest_sent_seq = 0
        self._last_progress = 0.0
        self._generation = 0
        self._session_alive = False
        self._session: EventSession | None = None
        self._acks_this_session = 0
        self._overflowing = False
        self._episode_dropped = 0
        self._warned_stale = False
        self._batches_flushed = 0
        self._batches_sent = 0
        self._batches_resent = 0
        self._batches_acked = 0
        self._batches_dropped = 0
        self._acks: dict[IngestResult, int] = dict.fromkeys(IngestResult, 0)
        self._sessions_opened = 0
        self._connect_failures = 0
        self._disconnects = 0
        self._commands_handled = 0
        self._commands_failed = 0
        self._last_error = ""

        self._wake_flusher = threading.Event()
        self._stop_flusher = threading.Event()
        self._stop_sender = threading.Event()
        self._flusher: threading.Thread | None = None
        self._sender: threading.Thread | None = None

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
            name = self._config.instance_id
            self._flusher = threading.Thread(
                target=self._run_flusher, name=f"event-flusher-{name}", daemon=True
            )
            self._sender = threading.Thread(
                target=self._run_sender, name=f"event-sender-{name}", daemon=True
            )
        self._flusher.start()
        self._sender.start()

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
            with self._cond:
                return not self._window
        self._stop_flusher.set()
        self._wake_flusher.set()
        if self._flusher is not None:
            self._flusher.join(max(0.0, deadline - self._clock()))
        self.flush()
        if self._sender is not None:
            drained = self.wait_until_drained(max(0.0, deadline - self._clock()))
        else:
            with self._cond:
                drained = not self._window
        self._stop_sender.set()
        with self._cond:
            session = self._session
            self._cond.notify_all()
        if session is not None:
            # Unblocks a sender stuck in send() on a wedged stream.
            _close_quietly(session)
        if self._sender is not None:
            self._sender.join(max(0.1, deadline - self._clock()))
            if self._sender.is_alive():
                logger.warning("event sender thread did not stop within the close timeout")
        if not drained:
            with self._cond:
                left = len(self._window)
            logger.warning(
                "closing event emitter %s/%d with %d unacked batches",
                self._config.instance_id,
                self._config.incarnation,
                left,
            )
        return drained

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
            with self._cond:
                first_seq = self._next_seq
                self._next_seq += count
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
            sized = [_Unacked(b, _estimate_bytes(b)) for b in batches]
            revision = self._capacity_revision
            with self._cond:
                self._window.extend(sized)
                self._window_bytes += sum(u.size_bytes for u in sized)
                self._batches_flushed += count
                dropped = self._enforce_window_bounds()
                self._cond.notify_all()
        if dropped:
            self._after_overflow(dropped, revision)
        return count

    def _enforce_window_bounds(self) -> list[_Unacked]:
        """Drop the oldest unacked batches beyond the bounds (caller holds _cond)."""
        cfg = self._config
        dropped: list[_Unacked] = []
        window = self._window
        while len(window) > cfg.max_buffered_batches or (
            self._window_bytes > cfg.max_buffered_bytes and len(window) > 1
        ):
            victim = window.popleft()
            self._window_bytes -= victim.size_bytes
            dropped.append(victim)
        if dropped:
            self._batches_dropped += len(dropped)
            self._episode_dropped += len(dropped)
            if window and self._next_send_seq < window[0].batch.seq:
                self._next_send_seq = window[0].batch.seq
        return dropped

    def _after_overflow(self, dropped: list[_Unacked], revision: int) -> None:
        with self._cond:
            first_of_episode = not self._overflowing
            self._overflowing = True
        if first_of_episode:
            logger.warning(
                "event window full (%d batches / %d bytes max): dropping the oldest unacked "
                "batches from seq %d; the coordinator will see a gap. Further drops are counted "
                "in batches_dropped until the window drains",
                self._config.max_buffered_batches,
                self._config.max_buffered_bytes,
                dropped[0].batch.seq,
            )
        # A lost declaration would leave the coordinator without our capacity;
        # queue it again (at a new revision) unless a newer one is pending.
        lost_config = any(
            u.batch.event_type is EventType.CONFIG and u.batch.capacity_revision == revision
            for u in dropped
        )
        if lost_config:
            self.redeclare_capacity()

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

    def _run_sender(self) -> None:
        cfg = self._config
        backoff = ReconnectBackoff(
            cfg.reconnect_base_s, cfg.reconnect_max_s, cfg.reconnect_jitter, self._rng
        )
        while not self._stop_sender.is_set():
            session, generation = self._open_session()
            if session is not None:
                progressed = self._pump(session, generation)
                with self._cond:
                    self._session_alive = False
                    self._session = None
                _close_quietly(session)
                # A stream that delivered something was healthy: retry quickly.
                # One that died before any ack keeps backing off, so a
                # coordinator that accepts and then drops us is not hammered.
                if progressed:
                    backoff.reset()
            if self._stop_sender.is_set():
                return
            self._stop_sender.wait(backoff.next_delay())

    def _open_session(self) -> tuple[EventSession | None, int]:
        with self._cond:
            self._generation += 1
            generation = self._generation
            # Alive before connect: a session may report on_closed from inside connect.
            self._session_alive = True
            self._acks_this_session = 0
        listener = _Listener(self, generation)
        try:
            session = self._transport.connect(
                self._config.instance_id, self._config.incarnation, listener
            )
        except Exception as exc:
            with self._cond:
                self._session_alive = False
                self._connect_failures += 1
                self._last_error = f"connect: {exc}"
                failures = self._connect_failures
            # Log the first failure and then sparsely: a coordinator outage
            # must not flood the log at the backoff rate.
            if failures == 1 or failures % 100 == 0:
                logger.warning("cannot open event stream (%d failures so far): %s", failures, exc)
            if not isinstance(exc, TransportError):
                logger.debug("unexpected connect error", exc_info=True)
            return None, generation
        with self._cond:
            self._session = session
            if self._sessions_opened:
                logger.info(
                    "event stream reopened; resending %d unacked batches", len(self._window)
                )
            self._sessions_opened += 1
            # Resend everything unacked, in order: the gate dedups what it already has.
            first = self._window[0].batch.seq if self._window else self._next_seq
            self._next_send_seq = first
            self._last_progress = self._clock()
        return session, generation

    def _pump(self, session: EventSession, generation: int) -> bool:
        """Send batches until the session dies or the emitter stops; True if any ack came."""
        while True:
            with self._cond:
                to_send = self._next_to_send(generation)
                if to_send is None:
                    return self._acks_this_session > 0
            for batch in to_send:
                with self._cond:
                    # An attempt counts: a batch whose send raised is "resent" next time.
                    resend = batch.seq <= self._highest_sent_seq
                    self._highest_sent_seq = max(self._highest_sent_seq, batch.seq)
                try:
                    session.send(batch)
                except Exception as exc:
                    with self._cond:
                        self._mark_session_dead(generation, f"send: {exc}")
                        progressed = self._acks_this_session > 0
                    logger.info("event stream send failed (seq %d): %s", batch.seq, exc)
                    if not isinstance(exc, TransportError):
                        logger.debug("unexpected send error", exc_info=True)
                    return progressed
                with self._cond:
                    self._batches_sent += 1
                    if resend:
                        self._batches_resent += 1

    def _next_to_send(self, generation: int) -> list[CacheEventBatch] | None:
        """Wait (holding _cond) for batches to send; None when the session must end."""
        cfg = self._config
        while True:
            if self._stop_sender.is_set() or not self._session_alive:
                return None
            if generation != self._generation:
                return None
            window = self._window
            base = window[0].batch.seq if window else self._next_seq
            self._next_send_seq = max(self._next_send_seq, base)
            in_flight = self._next_send_seq - base
            unsent = len(window) - in_flight
            now = self._clock()
            if in_flight > 0 and now - self._last_progress >= cfg.ack_timeout_s:
                self._mark_session_dead(
                    generation, f"no ack for {cfg.ack_timeout_s:g}s with {in_flight} in flight"
                )
                logger.warning(
                    "event stream: no ack for %.1fs with %d batches in flight; reconnecting",
                    cfg.ack_timeout_s,
                    in_flight,
                )
                return None
            room = cfg.max_in_flight_batches - in_flight
            if unsent > 0 and room > 0:
                if in_flight == 0:
                    # The ack clock runs only while something is outstanding.
                    self._last_progress = now
                batch_list = [
                    u.batch for u in itertools.islice(window, in_flight, in_flight + room)
                ]
                self._next_send_seq = batch_list[-1].seq + 1
                return batch_list
            timeout = None
            if in_flight > 0:
                timeout = max(0.0, cfg.ack_timeout_s - (now - self._last_progress))
            self._cond.wait(timeout)

    def _mark_session_dead(self, generation: int, reason: str) -> None:
        if generation == self._generation and self._session_alive:
            self._session_alive = False
            self._disconnects += 1
            self._last_error = reason
            self._cond.notify_all()

    def _on_session_closed(self, generation: int, error: BaseException | None) -> None:
        with self._cond:
            self._mark_session_dead(
                generation, "stream closed" if error is None else f"stream error: {error}"
            )

    def _on_ack(self, generation: int, seq: int, result: IngestResult) -> None:
        warn_stale = False
        drained_after_overflow = 0
        with self._cond:
            if seq < 1 or seq >= self._next_seq:
                logger.warning("ignoring ack for seq %d never flushed", seq)
                return
            try:
                verdict = IngestResult(result)
            except ValueError:
                logger.warning("ignoring ack for seq %d with unknown result %r", seq, result)
                return
            self._acks[verdict] += 1
            if verdict is IngestResult.STALE_INCARNATION and not self._warned_stale:
                self._warned_stale = True
                warn_stale = True
            # Cumulative: an ordered stream acked N, so every seq <= N was processed.
            removed = 0
            window = self._window
            while window and window[0].batch.seq <= seq:
                self._window_bytes -= window.popleft().size_bytes
                removed += 1
            self._acked_through = max(self._acked_through, seq)
            if removed:
                self._batches_acked += removed
                self._last_progress = self._clock()
                if generation == self._generation:
                    self._acks_this_session += 1
                if not window and self._overflowing:
                    self._overflowing = False
                    drained_after_overflow = self._episode_dropped
                    self._episode_dropped = 0
                self._cond.notify_all()
        if warn_stale:
            logger.error(
                "coordinator answered STALE_INCARNATION for %s/%d: a newer incarnation of this "
                "instance_id reported already (duplicate instance_id or a zombie process)",
                self._config.instance_id,
                self._config.incarnation,
            )
        if drained_after_overflow:
            logger.info("event window drained after dropping %d batches", drained_after_overflow)

    def wait_until_acked(self, seq: int, timeout: float | None = None) -> bool:
        """Block until every batch up to ``seq`` is acked or dropped; False on timeout."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                base = self._window[0].batch.seq if self._window else self._next_seq
                if base > seq:
                    return True
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)

    def wait_until_drained(self, timeout: float | None = None) -> bool:
        """Block until every flushed batch is acked or dropped; False on timeout."""
        with self._cond:
            last = self._next_seq - 1
        return self.wait_until_acked(last, timeout)

    # ----------------------------------------------------------------- commands

    def execute_command(self, command: NodeCommand) -> CommandResult:
        """Run ``command`` through the node's handler and describe the outcome; never raises.

        Events the handler recorded are flushed before returning, so
        ``effects_through_seq`` covers them.
        """
        handler = self._command_handler
        code, message, affected = "OK", "", 0
        if handler is None:
            code, message = "UNIMPLEMENTED", "this node does not accept coordinator commands"
        else:
            try:
                affected = int(handler.handle_command(command))
            except KvmeshError as exc:
                code, message = exc.code, exc.message
            except Exception as exc:
                logger.exception(
                    "command %s (%s) failed", command.command_id, type(command).__name__
                )
                code, message = "INTERNAL", f"{type(exc).__name__}: {exc}"
        self.flush()
        with self._cond:
            through = self._next_seq - 1
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
        with self._cond:
            return self._next_seq - 1

    def unacked_batches(self) -> list[CacheEventBatch]:
        """The flushed batches not yet acked, oldest first (a copy)."""
        with self._cond:
            return [u.batch for u in self._window]

    def stats(self) -> EmitterStats:
        """A consistent-enough snapshot of every counter."""
        with self._lock:
            pending_batches = len(self._pending)
            pending_entries = self._pending_entries
            ignored = self._records_ignored_empty
            after_close = self._records_after_close
        with self._cond:
            return EmitterStats(
                instance_id=self._config.instance_id,
                incarnation=self._config.incarnation,
                last_seq=self._next_seq - 1,
                acked_through_seq=self._acked_through,
                pending_batches=pending_batches,
                pending_entries=pending_entries,
                records_ignored_empty=ignored,
                records_after_close=after_close,
                batches_flushed=self._batches_flushed,
                batches_sent=self._batches_sent,
                batches_resent=self._batches_resent,
                batches_acked=self._batches_acked,
                batches_dropped=self._batches_dropped,
                acks_admitted=self._acks[IngestResult.ADMITTED],
                acks_duplicate=self._acks[IngestResult.DUPLICATE],
                acks_stale=self._acks[IngestResult.STALE_INCARNATION],
                window_depth=len(self._window),
                window_bytes=self._window_bytes,
                connected=self._session is not None and self._session_alive,
                sessions_opened=self._sessions_opened,
                reconnects=max(0, self._sessions_opened - 1),
                connect_failures=self._connect_failures,
                disconnects=self._disconnects,
                capacity_revision=self._capacity_revision,
                commands_handled=self._commands_handled,
                commands_failed=self._commands_failed,
                last_error=self._last_error,
            )


_UINT32_LIMIT = 1 << 32


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


def _close_quietly(session: EventSession) -> None:
    try:
        session.close()
    except Exception:
        logger.debug("closing an event session failed", exc_info=True)


# --------------------------------------------------------------------------------------
# In-process transport
# --------------------------------------------------------------------------------------


class IngestTarget(Protocol):
    """Anything with the coordinator gate's ``ingest`` (the real EventGate, or a fake)."""

    def ingest(self, batch: CacheEventBatch) -> IngestResult:
        """Admit, dedup or reject one batch."""
        ...


class LoopbackTransport:
    """An in-process :class:`EventTransport` that hands batches straight to ``target.ingest``.

    For tests, and for a single-process fleet with an embedded coordinator.
    Acks are delivered synchronously from ``send``. Faults can be injected:
    :meth:`set_down` / :meth:`fail_next_connects` make ``connect`` fail,
    :meth:`set_drop_acks` ingests without acking (a half-dead stream),
    :meth:`disconnect_every` breaks the stream on every n-th send — either
    before the batch reaches the target (lost in transit) or after (ack
    lost) — and :meth:`disconnect` breaks it now. :meth:`push_command`
    sends a command down the live stream; results land in
    :attr:`command_results`, as a real session would write them upstream.
    """

    def __init__(self, target: IngestTarget) -> None:
        self._target = target
        self._lock = threading.Lock()
        self._down = False
        self._connect_failures_left = 0
        self._drop_acks = False
        self._every: int | None = None
        self._after_delivery = False
        self._send_count = 0
        self._fail_sends_left = 0
        self._fail_sends_after_delivery = False
        self._session: _LoopbackSession | None = None
        #: Sessions successfully opened so far.
        self.sessions_opened = 0
        #: Every batch handed to the target, in order (resends included).
        self.delivered: list[CacheEventBatch] = []
        #: Command results the node sent back up the stream.
        self.command_results: list[CommandResult] = []

    # Fault injection ---------------------------------------------------------

    def set_down(self, down: bool) -> None:
        """While down, every ``connect`` raises and the live session (if any) breaks."""
        with self._lock:
            self._down = down
        if down:
            self.disconnect()

    def fail_next_connects(self, count: int) -> None:
        """Make the next ``count`` connects raise TransportError."""
        with self._lock:
            self._connect_failures_left = count

    def set_drop_acks(self, drop: bool) -> None:
        """Ingest batches but never ack them (the stream stays open)."""
        with self._lock:
            self._drop_acks = drop

    def disconnect_every(self, sends: int | None, *, after_delivery: bool = False) -> None:
        """Break the stream on every ``sends``-th send (None turns it off).

        ``after_delivery`` False: that batch never reaches the target and
        ``send`` raises. True: the target ingests it, the ack is lost and the
        stream reports itself closed.
        """
        if sends is not None and sends < 1:
            raise ValueError("sends must be >= 1")
        with self._lock:
            self._every = sends
            self._after_delivery = after_delivery
            self._send_count = 0

    def fail_next_sends(self, count: int, *, after_delivery: bool = False) -> None:
        """Break the stream on each of the next ``count`` sends (see :meth:`disconnect_every`)."""
        with self._lock:
            self._fail_sends_left = count
            self._fail_sends_after_delivery = after_delivery

    def disconnect(self) -> None:
        """Break the live stream now (the emitter sees on_closed with an error)."""
        with self._lock:
            session = self._session
            self._session = None
        if session is not None:
            session.fail(TransportError("loopback stream broken"))

    def push_command(self, command: NodeCommand) -> CommandResult:
        """Send ``command`` down the live stream; return (and record) the node's result."""
        with self._lock:
            session = self._session
        if session is None or session.closed:
            raise TransportError("no live event stream to send the command on")
        result = session.listener.on_command(command)
        with self._lock:
            self.command_results.append(result)
        return result

    @property
    def connected(self) -> bool:
        """True while a session is open."""
        with self._lock:
            return self._session is not None and not self._session.closed

    # EventTransport ------------------------------------------------------------

    def connect(
        self, instance_id: str, incarnation: int, listener: SessionListener
    ) -> _LoopbackSession:
        """Open a session, unless told to fail."""
        with self._lock:
            if self._down:
                raise TransportError("loopback coordinator is down")
            if self._connect_failures_left > 0:
                self._connect_failures_left -= 1
                raise TransportError("loopback connect refused")
            session = _LoopbackSession(self, listener)
            self._session = session
            self.sessions_opened += 1
        return session

    def _deliver(self, session: _LoopbackSession, batch: CacheEventBatch) -> None:
        with self._lock:
            if session.closed:
                raise TransportError("loopback stream is closed")
            self._send_count += 1
            breaking = self._every is not None and self._send_count % self._every == 0
            after_delivery = self._after_delivery
            if self._fail_sends_left > 0:
                self._fail_sends_left -= 1
                breaking = True
                after_delivery = self._fail_sends_after_delivery
            if breaking and not after_delivery:
                self._session = None
                session.closed = True
                raise TransportError("loopback stream broke before delivery")
            drop_ack = self._drop_acks
            try:
                result = self._target.ingest(batch)
            except Exception as exc:
                self._session = None
                session.closed = True
                raise TransportError(f"coordinator rejected the batch: {exc}") from exc
            self.delivered.append(batch)
            if breaking:
                self._session = None
        if breaking:
            session.fail(TransportError("loopback stream broke after delivery"))
            return
        if not drop_ack:
            session.listener.on_ack(batch.seq, result)

    def _closed(self, session: _LoopbackSession) -> None:
        with self._lock:
            if self._session is session:
                self._session = None


class _LoopbackSession:
    """One loopback stream."""

    def __init__(self, transport: LoopbackTransport, listener: SessionListener) -> None:
        self._transport = transport
        self.listener = listener
        self.closed = False
        self._fail_lock = threading.Lock()
        self._failed = False

    def send(self, batch: CacheEventBatch) -> None:
        """Deliver to the target and ack synchronously (unless a fault is injected)."""
        self._transport._deliver(self, batch)

    def close(self) -> None:
        """Close without notifying the listener (the emitter asked for it)."""
        self.closed = True
        self._transport._closed(self)

    def fail(self, error: BaseException) -> None:
        """Break the stream and tell the listener once."""
        self.closed = True
        with self._fail_lock:
            if self._failed:
                return
            self._failed = True
        self.listener.on_closed(error)
