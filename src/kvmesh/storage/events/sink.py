"""EmitterSink: the storage core's :class:`~kvmesh.storage.core.ports.EventSink`, over the emitter.

The core reports placement changes as ``(key, size)`` pairs and capacity as
:class:`~kvmesh.storage.core.ports.CapacityModule` values; this adapter turns
them into what :class:`~kvmesh.storage.events.emitter.CacheEventEmitter`
records, so the core never imports the event pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvmesh.common.events import CacheEventEntry, EventType, SegmentHead, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.ports import CapacityModule
from kvmesh.storage.events.emitter import CacheEventEmitter

__all__ = ["EmitterSink"]


class EmitterSink:
    """The storage core's EventSink, feeding the cache-event emitter."""

    def __init__(self, emitter: CacheEventEmitter) -> None:
        self.emitter = emitter
        #: A segment's head by key, for STORE entries (the node's segment catalog).
        self.segment_of: Callable[[ObjectKey], SegmentHead | None] = lambda key: None

    def record(
        self,
        event_type: EventType,
        tier: Tier,
        backend: str,
        shared: bool,
        entries: Sequence[tuple[ObjectKey, int]],
    ) -> None:
        if event_type is EventType.STORE:
            head = self.segment_of
            rows = [CacheEventEntry(k, size, segment=head(k)) for k, size in entries]
        else:
            rows = [CacheEventEntry(k, size) for k, size in entries]
        self.emitter.record(event_type, tier, backend, shared, rows)

    def record_capacity(self, modules: Sequence[CapacityModule]) -> None:
        self.emitter.record_capacity(
            (m.tier, m.backend, m.shared, m.capacity_bytes) for m in modules
        )
