"""When the coordinator core loads and saves its state, and which timers it runs.

At load, metadata comes first (so restored keys are already pinned), then
the checkpoint, then the eviction readiness gate is armed for one heartbeat
period. :meth:`CoreRuntime.start` arms it again and starts the timers
(daemon threads, sleep first); :meth:`CoreRuntime.stop` stops them, then
writes a final checkpoint — unless the state was never loaded, whose empty
state would overwrite the good checkpoint on disk.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from kvmesh.common.errors import FailedPrecondition

from .eviction import FleetEvictionController
from .persistence import (
    DurableComponent,
    LoadReport,
    MetadataStore,
    load_checkpoint,
    save_checkpoint,
)
from .quiesce import QuiesceLock
from .scheduler import PeriodicTask
from .settings import CoordinatorSettings
from .types import CheckpointResult

logger = logging.getLogger(__name__)

TimerSpec = tuple[str, float, Callable[[], object]]
"""``(name, interval in seconds, job)``; an interval of 0 disables the timer."""


class CoreRuntime:
    """Load, checkpoint, timers and stop of one core, with what they last did."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        *,
        quiesce: QuiesceLock,
        metadata: MetadataStore,
        checkpoint_components: list[DurableComponent],
        eviction: FleetEvictionController,
        timers: Sequence[TimerSpec],
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._quiesce = quiesce
        self._metadata = metadata
        # The coordinator's own list: sources append their sections before load.
        self._components = checkpoint_components
        self._eviction = eviction
        self._timer_specs = tuple(timers)
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._tasks: list[PeriodicTask] = []
        self._loaded = False
        self._stopped = False
        self.started = False
        self.started_at: float | None = None
        self.last_checkpoint: CheckpointResult | None = None
        self.last_checkpoint_time: float | None = None
        self.last_load: LoadReport | None = None

    @property
    def running(self) -> bool:
        """True between start and stop."""
        return self.started and not self._stopped

    @property
    def timers(self) -> tuple[PeriodicTask, ...]:
        """Running periodic tasks."""
        return tuple(self._tasks)

    def load_state(self) -> LoadReport | None:
        """Load metadata, then the checkpoint, once; None without a checkpoint path."""
        with self._lock:
            if self._loaded:
                return self.last_load
            self._loaded = True
            self._metadata.load()
            path = self._settings.checkpoint_path
            if path:
                self.last_load = load_checkpoint(path, self._components)
                if self.last_load.restored:
                    self.last_checkpoint_time = _file_mtime(path)
            self._eviction.arm_readiness()
            return self.last_load

    def start(self) -> None:
        """Load state if not done yet, arm the eviction readiness gate, start the timers."""
        self.load_state()
        with self._lock:
            if self.started:
                return
            if self._stopped:
                raise FailedPrecondition("a stopped coordinator cannot be restarted")
            self.started = True
            self.started_at = self._wall()
            self._eviction.arm_readiness()
            self._tasks.extend(
                PeriodicTask(name, interval, job)
                for name, interval, job in self._timer_specs
                if interval > 0
            )
            for task in self._tasks:
                task.start()
        logger.info("Coordinator started (%d timers)", len(self._tasks))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the timers, then write the final checkpoint (when a path is set). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            tasks, self._tasks = self._tasks, []
            loaded = self._loaded
        for task in tasks:
            task.stop(timeout)
        if self._settings.checkpoint_path and loaded:
            self.checkpoint_now()
        logger.info("Coordinator stopped")

    def checkpoint_now(self, timeout: float | None = None) -> CheckpointResult:
        """Capture under quiesce and write the checkpoint now; failures are in the result.

        Raises FailedPrecondition when no checkpoint path is configured.
        """
        path = self._settings.checkpoint_path
        if not path:
            raise FailedPrecondition("no checkpoint path is configured")
        result = save_checkpoint(
            path,
            self._quiesce,
            self._components,
            self._settings.quiesce_timeout if timeout is None else timeout,
        )
        self.last_checkpoint = result
        if result.ok:
            self.last_checkpoint_time = self._wall()
        return result


def _file_mtime(path: str) -> float | None:
    try:
        return os.path.getmtime(path)
    except OSError:
        return None
