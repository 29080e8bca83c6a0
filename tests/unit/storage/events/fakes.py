"""Test doubles for the emitter tests: a gate, with docs/coordinator.md "Event gate" semantics.

:class:`LoopbackTransport` is an in-process event transport that hands
batches straight to a gate (a :class:`FakeGate`), with fault injection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvmesh.common.events import (
    CacheEventBatch,
    CacheEventEntry,
    IngestResult,
    validate_batch,
)
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.ports import NodeCommand
from kvmesh.storage.events.transport import CommandResult, SessionListener, TransportError

DEADLINE_S = 10.0


def key(i: int, *, salt: str = "", model: str = "m") -> ObjectKey:
    """A valid key whose chunk hash encodes ``i``."""
    return ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name=model, kv_rank=0, cache_salt=salt)


def entry(i: int, size: int = 0) -> CacheEventEntry:
    """An entry for ``key(i)``."""
    return CacheEventEntry(key=key(i), size_bytes=size)


def key_id(e: CacheEventEntry) -> int:
    """Inverse of :func:`key` for assertions."""
    return int.from_bytes(e.key.chunk_hash, "big")


@dataclass
class Cursor:
    """Per-emitter stream position, as the coordinator's gate keeps it."""

    incarnation: int
    last_seq: int = 0
    gap_detected: bool = False


class FakeGate:
    """The reference EventGate's admission rules, recording what it admitted.

    Fresh cursor per new emitter or incarnation; stale incarnation dropped;
    ``seq <= last_seq`` is a duplicate; a jump flags a (sticky) gap but is
    admitted. Every batch is validated as the real ingest would.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.cursors: dict[str, Cursor] = {}
        self.admitted: list[CacheEventBatch] = []
        self.verdicts: list[tuple[int, IngestResult]] = []
        self.fenced: list[str] = []

    def ingest(self, batch: CacheEventBatch) -> IngestResult:
        validate_batch(batch)
        with self._cond:
            result = self._admit(batch)
            self.verdicts.append((batch.seq, result))
            self._cond.notify_all()
            return result

    def _admit(self, batch: CacheEventBatch) -> IngestResult:
        cursor = self.cursors.get(batch.instance_id)
        if cursor is not None:
            if batch.incarnation < cursor.incarnation:
                return IngestResult.STALE_INCARNATION
            if batch.incarnation > cursor.incarnation:
                self.fenced.append(batch.instance_id)
                cursor = None
            elif batch.seq <= cursor.last_seq:
                return IngestResult.DUPLICATE
        if cursor is None:
            cursor = Cursor(incarnation=batch.incarnation)
            self.cursors[batch.instance_id] = cursor
        if batch.seq > cursor.last_seq + 1:
            cursor.gap_detected = True
        cursor.last_seq = batch.seq
        self.admitted.append(batch)
        return IngestResult.ADMITTED

    def wait_for(self, predicate: Callable[[FakeGate], bool], timeout: float = DEADLINE_S) -> bool:
        """Block until ``predicate(self)`` holds (re-checked on every ingest) or timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def admitted_seqs(self) -> list[int]:
        with self._cond:
            return [b.seq for b in self.admitted]

    def duplicates(self) -> int:
        with self._cond:
            return sum(1 for _, r in self.verdicts if r is IngestResult.DUPLICATE)


# --------------------------------------------------------------------------------------
# In-process transport
# --------------------------------------------------------------------------------------


class IngestTarget(Protocol):
    """Anything with the coordinator gate's ``ingest`` (the real EventGate, or a fake)."""

    def ingest(self, batch: CacheEventBatch) -> IngestResult:
        """Admit, dedup or reject one batch."""
        ...


class LoopbackTransport:
    """An in-process ``EventTransport`` that hands batches straight to ``target.ingest``.

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
