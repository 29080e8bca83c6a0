"""EmitterSink: the storage core's :class:`~kvmesh.storage.core.ports.EventSink`, over the emitter.

The core reports placement changes as ``(key, size)`` pairs and capacity as
:class:`~kvmesh.storage.core.ports.CapacityModule` values; this adapter turns
them into what :class:`~kvmesh.storage.events.emitter.CacheEventEmitter`
records, so the core never imports the event pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.common.events import CacheEventEntry, EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.ports import CapacityModule
from kvmesh.storage.events.emitter import CacheEventEmitter

__all__ = ["EmitterSink"]


class EmitterSink:
    """The storage core's EventSink, feeding the cache-event emitter."""

    def __init__(self, emitter: CacheEventEmitter) -> None:
        self.emitter = emitter

    def record(
        self,
        event_type: EventType,
        tier: Tier,
        backend: str,
        shared: bool,
        entries: Sequence[tuple[ObjectKey, int]],
    ) -> None:
        self.emitter.record(
            event_type, tier, backend, shared, [CacheEventEntry(k, size) for k, size in entries]
        )

    def record_capacity(self, modules: Sequence[CapacityModule]) -> None:
        self.emitter.record_capacity(
            (m.tier, m.backend, m.shared, m.capacity_bytes) for m in modules
        )
