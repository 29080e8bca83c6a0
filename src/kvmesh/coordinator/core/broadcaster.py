"""Fan-out of admitted batches and fences to the coordinator's consumers.

See docs/coordinator.md, "Broadcaster".

Consumers run in registration order; an exception in one is logged with the
batch identity and counted, and the remaining consumers still run (only the
failing consumer misses that batch). Registration must finish before
traffic starts: the list is not synchronised, and a consumer registered late
only sees later batches. The broadcaster holds no lock of its own; the gate
lock serialises every call.

Per-consumer stats (upstream's newer ``stats()``): batches delivered,
consume and fence failures and seconds spent applying, listed for every
consumer from registration on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvmesh.common.events import CacheEventBatch

from .types import ConsumerStats

logger = logging.getLogger(__name__)


@runtime_checkable
class CacheEventConsumer(Protocol):
    """A read model or controller fed by the event stream."""

    def consume(self, batch: CacheEventBatch) -> None:
        """Apply one admitted batch. Called once, in admission order; filter what you need."""

    def fence_instance(self, instance_id: str) -> None:
        """Drop the L1 state ``instance_id`` reported; L2-only views no-op."""


@dataclass(slots=True)
class _Tally:
    name: str
    consumer: CacheEventConsumer
    delivered: int = 0
    consume_failures: int = 0
    fence_failures: int = 0
    apply_seconds: float = 0.0


class CacheEventBroadcaster:
    """Calls every registered consumer, in order, with failure isolation."""

    def __init__(self) -> None:
        self._tallies: list[_Tally] = []

    def register(self, consumer: CacheEventConsumer, name: str | None = None) -> str:
        """Append ``consumer``; returns the name its stats are kept under.

        The name defaults to the class name; a repeated name gets a ``#n`` suffix.
        """
        if not isinstance(consumer, CacheEventConsumer):
            raise TypeError(f"{consumer!r} lacks consume() / fence_instance()")
        base = name or type(consumer).__name__
        taken = {t.name for t in self._tallies}
        chosen, n = base, 1
        while chosen in taken:
            n += 1
            chosen = f"{base}#{n}"
        self._tallies.append(_Tally(chosen, consumer))
        return chosen

    @property
    def consumer_names(self) -> tuple[str, ...]:
        """Registered consumer names, in delivery order."""
        return tuple(t.name for t in self._tallies)

    def broadcast(self, batch: CacheEventBatch) -> None:
        """Deliver ``batch`` to every consumer in registration order."""
        clock = time.perf_counter
        for tally in self._tallies:
            start = clock()
            try:
                tally.consumer.consume(batch)
            except Exception:
                tally.consume_failures += 1
                logger.exception(
                    "Cache-event consumer %s failed on batch %s", tally.name, batch.ident()
                )
            else:
                tally.delivered += 1
            tally.apply_seconds += clock() - start

    def fence_instance(self, instance_id: str) -> None:
        """Fence ``instance_id`` in every consumer, in registration order."""
        for tally in self._tallies:
            try:
                tally.consumer.fence_instance(instance_id)
            except Exception:
                tally.fence_failures += 1
                logger.exception(
                    "Cache-event consumer %s failed to fence %s", tally.name, instance_id
                )

    def stats(self) -> dict[str, ConsumerStats]:
        """Counters of every registered consumer (zeros before its first batch)."""
        return {
            t.name: ConsumerStats(
                name=t.name,
                batches_delivered=t.delivered,
                consume_failures=t.consume_failures,
                fence_failures=t.fence_failures,
                apply_seconds=t.apply_seconds,
            )
            for t in self._tallies
        }
