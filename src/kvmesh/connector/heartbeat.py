"""The connector's heartbeat: one daemon thread that keeps an engine known to its gateway.

The gateway reaps an engine that has been silent for ``engine_reap_seconds``
(unmapping its KV memory and ending its lookups' leases), so a killed engine
gives its memory back on its own. A live engine therefore beats: every
``interval_s`` the thread runs ``beat`` (the worker pings with its engine id
and registers again when the gateway no longer knows it; the scheduler pings
with the id its lookups carry). Anything slow — a registration that maps the
KV memory, a gateway that does not answer — happens on this thread, never on
the engine's forward path. :meth:`Heartbeat.wake` runs a beat at once (the
worker's hooks call it when a call found the engine unknown).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Heartbeat:
    """Runs ``beat`` every ``interval_s`` seconds on a daemon thread until :meth:`stop`."""

    def __init__(self, beat: Callable[[], None], interval_s: float, name: str) -> None:
        if interval_s <= 0:
            raise ValueError("the heartbeat interval must be > 0 seconds")
        self._beat = beat
        self.interval_s = interval_s
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.beats = 0

    def start(self) -> None:
        """Start beating (the first beat runs after one interval, or at :meth:`wake`)."""
        self._thread.start()

    def wake(self) -> None:
        """Run the next beat now rather than at the end of the interval."""
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop beating; waits up to ``timeout`` for a beat in progress."""
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                self._beat()
            except Exception:  # a beat never ends the thread: the next one tries again
                logger.exception("kvmesh heartbeat failed")
            self.beats += 1
