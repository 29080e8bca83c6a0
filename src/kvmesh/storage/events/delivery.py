"""Delivery of the emitter's numbered batches: the bounded window, acks and the sender thread.

The emitter (:mod:`kvmesh.storage.events.emitter`) numbers batches and hands
them to :class:`EventDelivery`, which owns everything after that:

* Seqs are reserved here (:meth:`EventDelivery.reserve`), so the window, the
  acks and ``last_seq`` share one lock and one numbering.
* Delivery is at-least-once: flushed batches wait in a bounded window until
  the coordinator acks them (admitted, duplicate and stale all count as
  delivered). The sender thread streams them in seq order through an
  :class:`~kvmesh.storage.events.transport.EventTransport`, at most
  ``max_in_flight_batches`` unacked per stream; when the stream breaks (or
  stays silent for ``ack_timeout_s`` with batches in flight) it reconnects
  with jittered exponential backoff and resends every unacked batch. The
  gate drops ``seq <= last_seq``, so at-least-once plus dedup is exactly
  once in the directory.
* When the window overflows, the *oldest* unacked batches are dropped; their
  seqs stay consumed, so the coordinator's gate flags the gap instead of
  silently missing events.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvmesh.common.events import CacheEventBatch, IngestResult
from kvmesh.storage.core.ports import NodeCommand
from kvmesh.storage.events.config import DeliveryStats, EmitterConfig, ReconnectBackoff
from kvmesh.storage.events.transport import (
    CommandResult,
    EventSession,
    EventTransport,
    TransportError,
)

logger = logging.getLogger(__name__)

__all__ = ["EventDelivery"]


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

    __slots__ = ("_delivery", "_generation", "_on_command")

    def __init__(
        self,
        delivery: EventDelivery,
        generation: int,
        on_command: Callable[[NodeCommand], CommandResult],
    ) -> None:
        self._delivery = delivery
        self._generation = generation
        self._on_command = on_command

    def on_ack(self, seq: int, result: IngestResult) -> None:
        self._delivery._on_ack(self._generation, seq, result)

    def on_command(self, command: NodeCommand) -> CommandResult:
        return self._on_command(command)

    def on_closed(self, error: BaseException | None) -> None:
        self._delivery._on_session_closed(self._generation, error)


class EventDelivery:
    """The window of flushed, unacked batches and the thread that sends them (module docstring).

    Commands that come down a session go to ``on_command`` (the emitter's
    :meth:`~kvmesh.storage.events.emitter.CacheEventEmitter.execute_command`).
    """

    def __init__(
        self,
        config: EmitterConfig,
        transport: EventTransport,
        on_command: Callable[[NodeCommand], CommandResult],
        rng: random.Random,
    ) -> None:
        self._config = config
        self._transport = transport
        self._on_command = on_command
        self._rng = rng
        self._clock = time.monotonic
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
        self._last_error = ""
        self._stop_sender = threading.Event()
        self._sender: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the sender thread (the emitter calls it once)."""
        self._sender = threading.Thread(
            target=self._run_sender, name=f"event-sender-{self._config.instance_id}", daemon=True
        )
        self._sender.start()

    def close(self, deadline: float) -> bool:
        """Wait until ``deadline`` (monotonic) for the acks, then stop; True if nothing is left."""
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

    # ----------------------------------------------------------------- the window

    def reserve(self, count: int) -> int:
        """Consume ``count`` consecutive seqs; returns the first."""
        with self._cond:
            first_seq = self._next_seq
            self._next_seq += count
            return first_seq

    def append(self, batches: Sequence[CacheEventBatch]) -> list[CacheEventBatch]:
        """Add freshly numbered batches to the window; returns those dropped to stay bounded."""
        sized = [_Unacked(b, _estimate_bytes(b)) for b in batches]
        with self._cond:
            self._window.extend(sized)
            self._window_bytes += sum(u.size_bytes for u in sized)
            self._batches_flushed += len(sized)
            dropped = self._enforce_window_bounds()
            self._cond.notify_all()
        return dropped

    def _enforce_window_bounds(self) -> list[CacheEventBatch]:
        """Drop the oldest unacked batches beyond the bounds (caller holds _cond)."""
        cfg = self._config
        dropped: list[CacheEventBatch] = []
        window = self._window
        while len(window) > cfg.max_buffered_batches or (
            self._window_bytes > cfg.max_buffered_bytes and len(window) > 1
        ):
            victim = window.popleft()
            self._window_bytes -= victim.size_bytes
            dropped.append(victim.batch)
        if dropped:
            self._batches_dropped += len(dropped)
            self._episode_dropped += len(dropped)
            if window and self._next_send_seq < window[0].batch.seq:
                self._next_send_seq = window[0].batch.seq
        return dropped

    def note_overflow(self, dropped: Sequence[CacheEventBatch]) -> None:
        """Log the first drop of an overflow episode (the rest are counted)."""
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
                dropped[0].seq,
            )

    # ----------------------------------------------------------------- the sender

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
        listener = _Listener(self, generation, self._on_command)
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

    # ----------------------------------------------------------------- acks

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

    # ----------------------------------------------------------------- inspection

    @property
    def last_seq(self) -> int:
        """Highest seq assigned so far (0 before the first flush)."""
        with self._cond:
            return self._next_seq - 1

    def window_empty(self) -> bool:
        """True when no flushed batch waits for its ack."""
        with self._cond:
            return not self._window

    def unacked_batches(self) -> list[CacheEventBatch]:
        """The flushed batches not yet acked, oldest first (a copy)."""
        with self._cond:
            return [u.batch for u in self._window]

    def stats(self) -> DeliveryStats:
        """A consistent snapshot of the delivery counters."""
        with self._cond:
            return DeliveryStats(
                last_seq=self._next_seq - 1,
                acked_through_seq=self._acked_through,
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
                connect_failures=self._connect_failures,
                disconnects=self._disconnects,
                last_error=self._last_error,
            )


def _close_quietly(session: EventSession) -> None:
    try:
        session.close()
    except Exception:
        logger.debug("closing an event session failed", exc_info=True)
