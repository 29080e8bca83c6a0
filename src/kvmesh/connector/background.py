"""Calls the scheduler makes without waiting for them, in order, on one thread.

vLLM's scheduler runs every hook on the engine's one loop: while a hook
waits for an RPC, no other request's step is scheduled. Calls whose answer
the scheduler does not need (``RetrieveAhead``, ``FreeLookupLocks``,
``EndSession``) go through a :class:`BackgroundCalls` instead: queued in a
few microseconds, sent from a daemon thread in the order they were queued.

Each call carries a key (a request id): :meth:`BackgroundCalls.wait_for`
blocks until the key's queued calls have run, for a caller whose next RPC
must come after them (a new lookup under a request id whose session is
still being ended).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class BackgroundCalls:
    """Runs calls in order on one daemon thread, started on first use."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[str, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        #: Queued calls not yet run, per key.
        self._pending: collections.Counter[str] = collections.Counter()

    def submit(self, key: str, call: Callable[[], None]) -> None:
        """Queue ``call`` under ``key``; returns at once. After :meth:`close`, runs it here."""
        with self._lock:
            if not self._closed:
                self._pending[key] += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
                # Under the lock: a close() cannot queue its stop ahead of this call.
                self._queue.put((key, call))
                return
        self._call(key, call)

    def wait_for(self, key: str, timeout: float) -> bool:
        """Block until no call queued under ``key`` is left to run; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._done:
            while self._pending[key]:
                left = deadline - time.monotonic()
                if left <= 0 or not self._done.wait(left):
                    return self._pending[key] == 0
            return True

    def close(self, timeout: float = 5.0) -> None:
        """Run what is queued, then stop the thread; later calls run in the caller."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, call = item
            try:
                self._call(key, call)
            finally:
                with self._done:
                    self._pending[key] -= 1
                    if self._pending[key] <= 0:
                        del self._pending[key]
                    self._done.notify_all()

    def _call(self, key: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception:  # never let the thread die: later calls still run
            logger.exception("%s: call for %s failed", self.name, key)
