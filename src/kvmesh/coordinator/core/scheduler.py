"""Background timers of the coordinator: one daemon thread per periodic job.

Each job sleeps first and then runs, every ``interval`` seconds, until
stopped (so nothing runs before the first interval, as in LMCache's loops).
A job that raises is logged and runs again next time. ``stop()`` wakes the
sleeper at once and joins the thread; a job that is running finishes first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class PeriodicTask:
    """Runs ``job`` every ``interval`` seconds on its own daemon thread."""

    def __init__(self, name: str, interval: float, job: Callable[[], object]) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self.name = name
        self.interval = interval
        self._job = job
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs = 0
        self.failures = 0

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name=f"kvmesh-{self.name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._job()
            except Exception:
                self.failures += 1
                logger.exception("Periodic job %s failed", self.name)
            finally:
                self.runs += 1

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop and join; False when the thread did not finish within ``timeout``."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            logger.error("Periodic job %s did not stop within %.1fs", self.name, timeout)
            return False
        return True

    @property
    def running(self) -> bool:
        """True while the thread is alive."""
        return self._thread is not None and self._thread.is_alive()
