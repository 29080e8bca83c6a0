"""Declared capacity of each instance's compartments (docs/coordinator.md, "Capacity").

CONFIG batches declare one compartment ``(tier, backend, shared)`` each. A
declaration is stamped ``(incarnation, capacity_revision)`` and stamps are
compared as tuples: an older stamp is a straggler and is dropped, a newer
one starts a fresh declaration (compartments it omits are retired), an
equal one extends the current declaration (a repeated compartment keeps the
last value). Incarnation comes first, so a restarted node's revision 1 beats
the old process's revision 9.

Capacity is configuration, not L1 state, so ``fence_instance`` does nothing;
``forget`` drops an instance's declaration. kvmesh wires ``forget`` into the
heartbeat-timeout path as well as deregistration (LMCache 0.5.6 only did
the latter, so a reaped node's capacity lingered; docs/coordinator.md, "Capacity").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from kvmesh.common.events import CacheEventBatch, EventType, Tier

from .persistence import PersistenceType
from .types import ModuleCapacity

logger = logging.getLogger(__name__)

_NO_STAMP = (-1, -1)


class ServerConfigRegistry:
    """Capacity declarations per instance, as a cache-event consumer."""

    name = "server_config"
    persistence_type = PersistenceType.CHECKPOINT

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_instance: dict[str, dict[tuple[Tier, str], ModuleCapacity]] = {}
        self._stamps: dict[str, tuple[int, int]] = {}
        self._restored = False

    def consume(self, batch: CacheEventBatch) -> None:
        """Apply a CONFIG batch; other types are ignored."""
        if batch.event_type != EventType.CONFIG:
            return
        stamp = (batch.incarnation, batch.capacity_revision)
        iid = batch.instance_id
        with self._lock:
            current = self._stamps.get(iid, _NO_STAMP)
            if stamp < current:
                logger.debug("Dropping straggler capacity declaration %s from %s", stamp, iid)
                return
            if stamp > current:
                self._by_instance[iid] = {}
                self._stamps[iid] = stamp
            self._by_instance.setdefault(iid, {})[(batch.tier, batch.backend)] = ModuleCapacity(
                tier=batch.tier,
                backend=batch.backend,
                capacity_bytes=batch.capacity_bytes,
                shared=batch.shared,
            )

    def fence_instance(self, instance_id: str) -> None:
        """Capacity is not L1 state: nothing to drop."""

    def forget(self, instance_id: str) -> None:
        """Drop ``instance_id``'s declaration and stamp (idempotent)."""
        with self._lock:
            self._by_instance.pop(instance_id, None)
            self._stamps.pop(instance_id, None)

    def get(self, instance_id: str) -> tuple[ModuleCapacity, ...]:
        """Compartments ``instance_id`` declared, sorted by (tier, backend)."""
        with self._lock:
            mods = self._by_instance.get(instance_id, {})
            return tuple(mods[k] for k in sorted(mods))

    def has_declaration(self, instance_id: str) -> bool:
        """True when ``instance_id`` declared at least one compartment."""
        with self._lock:
            return bool(self._by_instance.get(instance_id))

    def get_all(self) -> dict[str, tuple[ModuleCapacity, ...]]:
        """Snapshot of every declaration."""
        with self._lock:
            return {
                iid: tuple(mods[k] for k in sorted(mods)) for iid, mods in self._by_instance.items()
            }

    def stamp(self, instance_id: str) -> tuple[int, int] | None:
        """Current ``(incarnation, revision)`` of ``instance_id``'s declaration."""
        with self._lock:
            return self._stamps.get(instance_id)

    # -- durable component -------------------------------------------------

    def capture(self) -> dict[str, object]:
        """``{"declarations": [(id, inc, rev, [(tier, backend, capacity, shared)…])…]}``."""
        with self._lock:
            rows: list[object] = []
            for iid, (inc, rev) in self._stamps.items():
                mods = self._by_instance.get(iid, {})
                rows.append(
                    (
                        iid,
                        inc,
                        rev,
                        [
                            (int(m.tier), m.backend, m.capacity_bytes, m.shared)
                            for _k, m in sorted(mods.items())
                        ],
                    )
                )
            return {"declarations": rows}

    def restore(self, state: object) -> None:
        """Load declarations (and their stamps) into an empty registry."""
        if not isinstance(state, Mapping):
            raise TypeError("server_config state must be a mapping")
        rows = state.get("declarations")
        if not isinstance(rows, list | tuple):
            raise TypeError("server_config state has no 'declarations' list")
        by_instance: dict[str, dict[tuple[Tier, str], ModuleCapacity]] = {}
        stamps: dict[str, tuple[int, int]] = {}
        for row in rows:
            iid, inc, rev, mods = row
            if not isinstance(iid, str) or not isinstance(inc, int) or not isinstance(rev, int):
                raise ValueError(f"malformed capacity declaration {row!r}")
            table: dict[tuple[Tier, str], ModuleCapacity] = {}
            for tier_v, backend, cap, shared in mods:
                tier = Tier(tier_v)
                if not isinstance(backend, str) or not isinstance(cap, int) or cap < 0:
                    raise ValueError(f"malformed compartment in declaration of {iid!r}")
                table[(tier, backend)] = ModuleCapacity(tier, backend, cap, bool(shared))
            by_instance[iid] = table
            stamps[iid] = (inc, rev)
        with self._lock:
            if self._stamps or self._by_instance or self._restored:
                raise ValueError("server_config restore requires an empty registry")
            self._by_instance = by_instance
            self._stamps = stamps
            self._restored = True
