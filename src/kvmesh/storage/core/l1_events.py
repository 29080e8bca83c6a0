"""L1's placement events: what the L1 manager's listener calls become on an :class:`EventSink`.

Admissions are STORE/L1 (with the objects' sizes), removals of any reason
DELETE/L1, and uses ACCESS; a sink that refuses a batch is logged, never
raised into L1.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvmesh.common.events import EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1.results import RemovalReason
from kvmesh.storage.core.ports import EventSink

logger = logging.getLogger(__name__)

#: Backend name of the DRAM L1 in cache events (LMCache's ``L1BackendType.dram``).
L1_BACKEND = "dram"


class L1EventBridge:
    """Turns L1 listener calls into placement events."""

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink

    def on_admitted(self, keys: Sequence[ObjectKey], sizes: Sequence[int], from_l2: bool) -> None:
        self._emit(EventType.STORE, L1_BACKEND, list(zip(keys, sizes, strict=True)))

    def on_removed(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], reason: RemovalReason
    ) -> None:
        self._emit(EventType.DELETE, L1_BACKEND, [(k, 0) for k in keys])

    def on_touched(self, keys: Sequence[ObjectKey]) -> None:
        self._emit(EventType.ACCESS, "", [(k, 0) for k in keys])

    def _emit(
        self, event_type: EventType, backend: str, entries: list[tuple[ObjectKey, int]]
    ) -> None:
        try:
            self._sink.record(event_type, Tier.L1, backend, False, entries)
        except Exception:
            logger.exception("event sink rejected %s L1 events", event_type.name)
