"""Instance registry and heartbeat expiry (docs/coordinator.md, "Membership").

The registry is a view, not an event consumer, and is never checkpointed:
nodes re-register after a coordinator restart (a heartbeat for an unknown
id answers NOT_FOUND, meaning "register again"). Heartbeat ages use a
monotonic clock (injectable for tests); registration time is wall clock,
for display. ``stale(timeout)`` lists ids whose last heartbeat is *more*
than ``timeout`` seconds old.

Re-registration overwrites the entry (heartbeat included) and never touches
the gate cursor or capacity: a node that restarts under the same id is
fenced by its new incarnation, not by registering (docs/coordinator.md, "Membership").

kvmesh: the coordinator's sweep (:func:`evict_stale` plus the gate and
capacity calls in ``Coordinator.sweep_stale_instances``) fences the reaped
node's L1 *and* forgets its capacity declaration, which LMCache 0.5.6 left
unwired on timeout (docs/coordinator.md, "Capacity"). The same sweep drops
what is held of ids that are not registered at all and not heard from
(``Coordinator.sweep_unregistered``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

from .types import Endpoints, InstanceInfo

logger = logging.getLogger(__name__)


class InstanceRegistry:
    """Registered storage nodes and their last heartbeat."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self._instances: dict[str, InstanceInfo] = {}
        self._clock = clock
        self._wall = wall_clock

    def register(
        self,
        instance_id: str,
        *,
        incarnation: int = 0,
        endpoints: Endpoints | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> bool:
        """Add or replace ``instance_id``; True when it was registered already."""
        info = InstanceInfo(
            instance_id=instance_id,
            incarnation=incarnation,
            endpoints=endpoints or Endpoints(),
            metadata=MappingProxyType(dict(metadata or {})),
            registration_time=self._wall(),
            last_heartbeat=self._clock(),
        )
        with self._lock:
            existed = instance_id in self._instances
            self._instances[instance_id] = info
        return existed

    def deregister(self, instance_id: str) -> InstanceInfo | None:
        """Remove ``instance_id``; returns its entry, or None if it was unknown."""
        with self._lock:
            return self._instances.pop(instance_id, None)

    def _aged(self, info: InstanceInfo, now: float) -> InstanceInfo:
        return dataclasses.replace(info, heartbeat_age_seconds=max(0.0, now - info.last_heartbeat))

    def get(self, instance_id: str) -> InstanceInfo | None:
        """Entry of ``instance_id`` (with its heartbeat age) or None."""
        now = self._clock()
        with self._lock:
            info = self._instances.get(instance_id)
        return self._aged(info, now) if info is not None else None

    def contains(self, instance_id: str) -> bool:
        """True when ``instance_id`` is registered."""
        with self._lock:
            return instance_id in self._instances

    __contains__ = contains

    def all_instances(self) -> list[InstanceInfo]:
        """Snapshot of every entry with its heartbeat age, sorted by id."""
        now = self._clock()
        with self._lock:
            infos = sorted(self._instances.values(), key=lambda i: i.instance_id)
        return [self._aged(i, now) for i in infos]

    def random_instance(self) -> InstanceInfo | None:
        """A uniformly chosen entry, or None when empty."""
        with self._lock:
            if not self._instances:
                return None
            return random.choice(list(self._instances.values()))

    def update_heartbeat(self, instance_id: str) -> bool:
        """Record a heartbeat now; False for an unknown id."""
        now = self._clock()
        with self._lock:
            info = self._instances.get(instance_id)
            if info is None:
                return False
            self._instances[instance_id] = dataclasses.replace(info, last_heartbeat=now)
            return True

    def stale(self, timeout: float) -> list[str]:
        """Ids whose last heartbeat is more than ``timeout`` seconds old."""
        now = self._clock()
        with self._lock:
            return [
                iid for iid, info in self._instances.items() if now - info.last_heartbeat > timeout
            ]

    def deregister_if_stale(self, instance_id: str, timeout: float) -> bool:
        """Remove ``instance_id`` only if its heartbeat is still expired; True when removed."""
        now = self._clock()
        with self._lock:
            info = self._instances.get(instance_id)
            if info is None or now - info.last_heartbeat <= timeout:
                return False
            del self._instances[instance_id]
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._instances)


def evict_stale(registry: InstanceRegistry, timeout: float) -> list[str]:
    """Deregister every instance whose heartbeat expired; returns the ids actually removed."""
    removed: list[str] = []
    for iid in registry.stale(timeout):
        # Re-checked atomically: a heartbeat may have landed since stale().
        if registry.deregister_if_stale(iid, timeout):
            logger.warning("Instance %s missed heartbeats for over %.1fs; removed", iid, timeout)
            removed.append(iid)
    return removed
