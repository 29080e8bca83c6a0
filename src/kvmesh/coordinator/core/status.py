"""The operator's one-call overview of the coordinator core.

:func:`coordinator_status` reads the gate, the directory, the consumers, the
eviction controller, the metadata store and the runtime at once;
:class:`~.coordinator.Coordinator` exposes it as ``status()`` for
``kvmesh status`` and the admin service.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .components import CoreComponents
from .persistence import LoadReport
from .runtime import CoreRuntime
from .types import CheckpointResult, ConsumerStats, CursorInfo, DirectoryStats


@dataclass(frozen=True, slots=True)
class CoordinatorStatus:
    """One-call overview for ``kvmesh status`` and the admin service.

    ``started_at`` and ``last_checkpoint_time`` are wall-clock seconds
    (None: not started / no checkpoint written or restored yet); ``restored``
    is True when at least one checkpoint section was loaded at start.
    """

    started: bool
    started_at: float | None
    eviction_ready: bool
    instances: int
    directory: DirectoryStats
    cursors: Mapping[str, CursorInfo]
    consumers: Mapping[str, ConsumerStats]
    batches_admitted: int
    batches_duplicate: int
    batches_stale: int
    evictions_in_flight: int
    metadata_save_failures: int
    checkpoint_path: str
    last_checkpoint: CheckpointResult | None
    last_checkpoint_time: float | None
    restored: bool
    last_load: LoadReport | None
    chunk_size: int


def coordinator_status(core: CoreComponents, rt: CoreRuntime) -> CoordinatorStatus:
    """Everything an operator's status view shows."""
    cursors = core.gate.cursors()
    return CoordinatorStatus(
        started=rt.running,
        started_at=rt.started_at,
        eviction_ready=core.eviction.is_ready(),
        instances=len(core.registry),
        directory=core.directory.stats(),
        cursors=cursors,
        consumers=core.broadcaster.stats(),
        batches_admitted=sum(c.batches_admitted for c in cursors.values()),
        batches_duplicate=sum(c.batches_duplicate for c in cursors.values()),
        batches_stale=sum(c.batches_stale for c in cursors.values()),
        evictions_in_flight=core.eviction.in_flight_count(),
        metadata_save_failures=core.metadata.save_failures,
        checkpoint_path=core.settings.checkpoint_path,
        last_checkpoint=rt.last_checkpoint,
        last_checkpoint_time=rt.last_checkpoint_time,
        restored=bool(rt.last_load is not None and rt.last_load.restored),
        last_load=rt.last_load,
        chunk_size=core.settings.chunk_size,
    )
