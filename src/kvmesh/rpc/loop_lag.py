"""How late a service's event loop runs what is due: ``kvmesh_event_loop_lag_seconds``.

Every request a service answers waits for its event loop: a callback that
holds the loop, another thread that holds the GIL, or a loop thread that the
kernel leaves waiting for a core all delay every call alike, and none of them
shows in a handler's own latency. A :class:`LoopLagMonitor` task sleeps one
interval at a time (:data:`INTERVAL_S` unless the service sets
``loop_lag_interval_ms``) and records, each time it wakes, how much later
than due it ran. A stall of S seconds is recorded as S less up to one
interval (the part of the stall that fell inside the sleep).

A stall of :data:`WARN_S` or more also logs one WARNING, at most one every
:data:`WARN_EVERY_S` (the next one counts the stalls in between): a service
that freezes for a second is something an operator should hear about without
a dashboard. docs/observability.md lists the series; docs/performance.md
("The node's event loop at the query round's start") shows what it found.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

logger = logging.getLogger(__name__)

#: Seconds between the monitor's wake-ups (a service's ``loop_lag_interval_ms``). On a
#: 2-core VM an idle loop's wake-ups took 0.4 % of a core at 50 ms, 0.9 % at 20 ms and
#: 1.3 % at 10 ms (each wakes the sleeping loop thread).
INTERVAL_S = 0.05
#: Buckets of the lag (seconds); 0.02 is the "no request waits more than 20 ms" line.
LAG_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: A stall this long (seconds) logs a WARNING.
WARN_S = 1.0
#: At most one such WARNING per this many seconds.
WARN_EVERY_S = 60.0


class LoopLagMonitor:
    """Records the running loop's lateness into ``registry`` while started."""

    def __init__(
        self,
        registry: CollectorRegistry,
        service: str,
        *,
        interval_s: float = INTERVAL_S,
        warn_s: float = WARN_S,
        warn_every_s: float = WARN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.lag = Histogram(
            "kvmesh_event_loop_lag_seconds",
            f"How much later than due the service's event loop woke a timer set every "
            f"{interval_s * 1e3:g} ms (a stall shows as its length less up to that).",
            ["service"],
            buckets=LAG_BUCKETS,
            registry=registry,
        ).labels(service=service)
        self.service = service
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.warn_every_s = warn_every_s
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._last_warning: float | None = None
        self._unreported = 0
        self._longest_unreported = 0.0

    def start(self) -> None:
        """Start watching the running loop (a second start does nothing)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"kvmesh-loop-lag-{self.service}"
            )

    async def stop(self) -> None:
        """Stop watching; returns once the task is gone."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        while True:
            due = self._clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.observe(max(0.0, self._clock() - due))

    def observe(self, lag_s: float) -> None:
        """Record one wake-up ``lag_s`` late (the task's own step; tests call it too)."""
        self.lag.observe(lag_s)
        if lag_s < self.warn_s:
            return
        now = self._clock()
        self._unreported += 1
        self._longest_unreported = max(self._longest_unreported, lag_s)
        if self._last_warning is not None and now - self._last_warning < self.warn_every_s:
            return
        if self._unreported == 1:
            logger.warning(
                "%s: the event loop stalled for %.2f s (every call waited for it); "
                "kvmesh_event_loop_lag_seconds has the distribution",
                self.service,
                self._longest_unreported,
            )
        else:
            logger.warning(
                "%s: the event loop stalled %d times for %.1f s or more since the last "
                "warning, the longest %.2f s; kvmesh_event_loop_lag_seconds has the distribution",
                self.service,
                self._unreported,
                self.warn_s,
                self._longest_unreported,
            )
        self._last_warning = now
        self._unreported = 0
        self._longest_unreported = 0.0
