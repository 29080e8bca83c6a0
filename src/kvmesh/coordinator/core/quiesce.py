"""QuiesceLock: lets a checkpoint capture wait until no batch is being applied.

A leaf of the core: the gate brackets every batch with
``QuiesceLock.applying()`` and persistence captures its sections inside
``QuiesceLock.quiesced()``, so both import it and neither imports the other.
The lock refuses a second concurrent capturer instead of leaving that rule to
the callers (a kvmesh addition; LMCache's capture relied on its callers).

Lock order: ``applying()`` outside, the gate lock inside, then the consumers'
own locks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from kvmesh.common.errors import DeadlineExceeded

DEFAULT_QUIESCE_TIMEOUT_S = 5.0


class QuiesceTimeout(DeadlineExceeded, TimeoutError):
    """A capture could not quiesce ingest in time (batches stayed in flight)."""

    default_reason = "QUIESCE_TIMEOUT"


class QuiesceLock:
    """Lets a capture wait until no batch is being applied, and parks new batches meanwhile.

    ``applying()`` brackets one batch (the gate takes it around ``ingest`` and
    ``drop_instance``); it waits while a capture is pending, so a batch is
    parked before it starts, never half-way. ``quiesced(timeout)`` brackets a
    capture: it stops new batches and waits for the ones in flight.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._requested = False
        self._in_flight = 0
        # One capturer at a time: a second one queues behind the first
        # instead of clearing the first one's request on exit.
        self._capturer = threading.Lock()

    def applying(self) -> _Applying:
        """Context manager bracketing one batch; blocks while a capture is pending."""
        return _Applying(self)

    def _enter_apply(self) -> None:
        with self._cond:
            while self._requested:
                self._cond.wait()
            self._in_flight += 1

    def _exit_apply(self) -> None:
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        """Batches being applied right now."""
        with self._cond:
            return self._in_flight

    @contextmanager
    def quiesced(self, timeout: float = DEFAULT_QUIESCE_TIMEOUT_S) -> Iterator[None]:
        """Hold ingest still for the body; raise QuiesceTimeout if it cannot within ``timeout``.

        On timeout nothing stays blocked: the request is withdrawn and parked
        batches resume. Never call this from inside ``applying()`` or a
        consumer (it would wait for itself). Keep the body to in-memory reads.
        """
        deadline = time.monotonic() + timeout
        if not self._capturer.acquire(timeout=max(0.0, timeout)):
            raise QuiesceTimeout(
                f"another capture held the quiesce lock for {timeout:.1f}s",
                metadata={"in_flight": "unknown"},
            )
        try:
            with self._cond:
                self._requested = True
                while self._in_flight > 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        stuck = self._in_flight
                        self._requested = False
                        self._cond.notify_all()
                        raise QuiesceTimeout(
                            f"could not quiesce ingest within {timeout:.1f}s: "
                            f"{stuck} batch(es) still in flight",
                            metadata={"in_flight": str(stuck)},
                        )
                    self._cond.wait(left)
            try:
                yield
            finally:
                with self._cond:
                    self._requested = False
                    self._cond.notify_all()
        finally:
            self._capturer.release()


class _Applying:
    """Class-based context manager: cheaper per batch than a generator one."""

    __slots__ = ("_q",)

    def __init__(self, q: QuiesceLock) -> None:
        self._q = q

    def __enter__(self) -> None:
        self._q._enter_apply()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._q._exit_apply()
