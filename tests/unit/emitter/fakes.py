"""Test doubles for the emitter tests: a gate with the reference's §3.1 semantics, helpers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.common.events import (
    CacheEventBatch,
    CacheEventEntry,
    IngestResult,
    validate_batch,
)
from kvmesh.common.keys import ObjectKey

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


def wait_until(predicate: Callable[[], bool], timeout: float = DEADLINE_S) -> bool:
    """Poll ``predicate`` until true or the deadline passes; returns the last value."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return predicate()
        pause.wait(0.002)


@dataclass
class Cursor:
    """Per-emitter stream position, as the coordinator's gate keeps it."""

    incarnation: int
    last_seq: int = 0
    gap_detected: bool = False


class FakeGate:
    """The reference EventGate's admission rules (§3.1), recording what it admitted.

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
