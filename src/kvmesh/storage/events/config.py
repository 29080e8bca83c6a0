"""Settings, counters and the reconnect schedule of the cache-event emitter."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import Tier

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT_BATCHES",
    "DeliveryStats",
    "EmitterConfig",
    "EmitterStats",
    "ModuleCapacity",
    "ReconnectBackoff",
]

#: Batches sent and not yet acked per stream, by default. Two keep a batch
#: travelling while the coordinator applies the previous one, and when both
#: acks come back together the link sends the next two as one batch group,
#: halving gRPC's per-message cost on both ends (on the coordinator about as
#: much as applying a 64-entry batch). A larger window queues more per node
#: in front of the coordinator, which every batch's ack waits behind (it adds
#: latency, Little's law), and lets one catching-up node crowd out the rest.
#: ``kvmesh bench ingest`` runs this window by default (docs/benchmarks.md, "ingest").
DEFAULT_MAX_IN_FLIGHT_BATCHES = 2


class ModuleCapacity(NamedTuple):
    """Declared capacity of one compartment ``(tier, backend, shared)`` (0 = undeclared)."""

    tier: Tier
    backend: str
    shared: bool
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class EmitterConfig:
    """Settings of one :class:`CacheEventEmitter`.

    ``instance_id`` is stable across restarts (configured, or derived from
    host and port by the caller — never random per start); ``incarnation``
    comes from :func:`kvmesh.storage.core.incarnation.next_incarnation`.
    ``flush_interval_s`` 0 flushes after every record. The window holds at
    most ``max_buffered_batches`` unacked batches and about
    ``max_buffered_bytes`` (an estimate of their payload); beyond either the
    oldest are dropped. ``max_in_flight_batches`` bounds what is sent but not
    yet acked on one stream (see :data:`DEFAULT_MAX_IN_FLIGHT_BATCHES`); a
    stream with batches in flight and no ack for ``ack_timeout_s`` is
    treated as dead. Reconnects wait
    ``reconnect_base_s`` doubling up to ``reconnect_max_s``, each wait
    shortened by a random fraction up to ``reconnect_jitter``.
    """

    instance_id: str
    incarnation: int
    flush_interval_s: float = 0.05
    max_entries_per_batch: int = 1024
    max_buffered_batches: int = 65_536
    max_buffered_bytes: int = 256 * 1024 * 1024
    max_in_flight_batches: int = DEFAULT_MAX_IN_FLIGHT_BATCHES
    ack_timeout_s: float = 30.0
    reconnect_base_s: float = 0.05
    reconnect_max_s: float = 5.0
    reconnect_jitter: float = 0.2

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise InvalidArgument("instance_id must not be empty", field="instance_id")
        if self.incarnation < 0:
            raise InvalidArgument("incarnation must be >= 0", field="incarnation")
        if not self.flush_interval_s >= 0.0 or self.flush_interval_s == float("inf"):
            raise InvalidArgument(
                "flush_interval_s must be a finite value >= 0", field="flush_interval_s"
            )
        for name in ("max_entries_per_batch", "max_buffered_batches", "max_in_flight_batches"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1", field=name)
        if self.max_buffered_bytes < 1:
            raise InvalidArgument("max_buffered_bytes must be >= 1", field="max_buffered_bytes")
        if not self.ack_timeout_s > 0.0:
            raise InvalidArgument("ack_timeout_s must be > 0", field="ack_timeout_s")
        if not 0.0 < self.reconnect_base_s <= self.reconnect_max_s:
            raise InvalidArgument(
                "need 0 < reconnect_base_s <= reconnect_max_s", field="reconnect_base_s"
            )
        if not 0.0 <= self.reconnect_jitter <= 1.0:
            raise InvalidArgument("reconnect_jitter must be in [0, 1]", field="reconnect_jitter")


@dataclass(frozen=True, slots=True)
class EmitterStats:
    """A snapshot of the emitter's counters (for metrics and ``kvmesh status``)."""

    instance_id: str
    incarnation: int
    #: Highest seq assigned so far (0 before the first flush).
    last_seq: int
    #: Highest seq the coordinator acknowledged.
    acked_through_seq: int
    pending_batches: int
    pending_entries: int
    records_ignored_empty: int
    records_after_close: int
    batches_flushed: int
    batches_sent: int
    batches_resent: int
    batches_acked: int
    batches_dropped: int
    acks_admitted: int
    acks_duplicate: int
    acks_stale: int
    window_depth: int
    window_bytes: int
    connected: bool
    sessions_opened: int
    reconnects: int
    connect_failures: int
    disconnects: int
    capacity_revision: int
    commands_handled: int
    commands_failed: int
    last_error: str


@dataclass(frozen=True, slots=True)
class DeliveryStats:
    """The delivery side's counters, part of :class:`EmitterStats`."""

    last_seq: int
    acked_through_seq: int
    batches_flushed: int
    batches_sent: int
    batches_resent: int
    batches_acked: int
    batches_dropped: int
    acks_admitted: int
    acks_duplicate: int
    acks_stale: int
    window_depth: int
    window_bytes: int
    connected: bool
    sessions_opened: int
    connect_failures: int
    disconnects: int
    last_error: str


class ReconnectBackoff:
    """Exponential reconnect delays: ``base_s``, doubling per attempt, capped at ``max_s``.

    Each delay is shortened by a random fraction up to ``jitter`` so a fleet
    of nodes does not reconnect in lockstep after a coordinator restart;
    never lengthened, so the nominal value is an upper bound.
    """

    def __init__(self, base_s: float, max_s: float, jitter: float, rng: random.Random) -> None:
        self._base = base_s
        self._max = max_s
        self._jitter = jitter
        self._rng = rng
        self._current = base_s

    def next_delay(self) -> float:
        """The delay before the next attempt; advances the schedule."""
        delay = self._current * (1.0 - self._jitter * self._rng.random())
        self._current = min(self._current * 2.0, self._max)
        return delay

    def reset(self) -> None:
        """Start again from ``base_s`` (after a healthy connection)."""
        self._current = self._base
