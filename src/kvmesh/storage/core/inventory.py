"""What a storage node holds, per tenant and tier: quotas, usage, listings, resync.

Plain functions over the :class:`~kvmesh.storage.core.manager.StorageManager`,
called by :class:`~kvmesh.storage.core.node.StorageNode` for the
coordinator's node commands (a quota changed, a resync) and the operator's
listing RPCs. Event loop only, like the node.
"""

from __future__ import annotations

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1_events import L1_BACKEND
from kvmesh.storage.core.manager import StorageManager


def apply_quota(
    manager: StorageManager, cache_salt: str, tier: Tier, limit_bytes: int | None
) -> int:
    """Set (or with None remove) one tier of a salt's quota."""
    current = manager.get_quota(cache_salt)
    l1 = current.l1_bytes if current else None
    l2 = current.l2_bytes if current else None
    if tier is Tier.L1:
        l1 = limit_bytes
    elif tier is Tier.L2:
        l2 = limit_bytes
    else:
        raise InvalidArgument("a quota's tier must be L1 or L2", field="tier")
    if l1 is None and l2 is None:
        manager.delete_quota(cache_salt)
    else:
        manager.set_quota(cache_salt, l1_bytes=l1, l2_bytes=l2)
    return 1


def resync(manager: StorageManager, tier: Tier | None) -> int:
    """Re-announce every placement this node holds as STORE events.

    The coordinator asks for it when its view of this node has a hole (a
    cold start, a seq gap, a drop while this node lived on).
    """
    announced = 0
    sink = manager.event_sink
    if tier in (None, Tier.L1) and sink is not None:
        # Recorded under the L1 lock, in order with the L1 events of concurrent changes.
        announced += manager.l1.announce_resident(
            lambda entries: sink.record(EventType.STORE, Tier.L1, L1_BACKEND, False, entries)
        )
    if tier in (None, Tier.L2):
        for l2 in manager.tiers:
            announced += l2.rebuild_index()
    return announced


def salt_usage(manager: StorageManager, cache_salt: str, tier: Tier) -> tuple[int, int | None]:
    """(bytes the salt holds on the tier, its explicit limit or None)."""
    if tier is Tier.L1:
        used = manager.l1.bytes_by_salt().get(cache_salt, 0)
    else:
        used = sum(t.index.bytes_by_salt().get(cache_salt, 0) for t in manager.tiers)
    quota = manager.get_quota(cache_salt)
    limit = None
    if quota is not None:
        limit = quota.l1_bytes if tier is Tier.L1 else quota.l2_bytes
    return used, limit


def salts(manager: StorageManager, tier: Tier) -> list[str]:
    """Salts with bytes on the tier or a quota for it."""
    if tier is Tier.L1:
        found = set(manager.l1.bytes_by_salt())
    else:
        found = {s for t in manager.tiers for s in t.index.bytes_by_salt()}
    for salt, quota in manager.list_quotas().items():
        if (quota.l1_bytes if tier is Tier.L1 else quota.l2_bytes) is not None:
            found.add(salt)
    return sorted(found)


def list_objects(
    manager: StorageManager, tier: Tier | None, backend: str, model_name: str
) -> list[tuple[ObjectKey, Tier, str, int]]:
    """Objects held by this node (a snapshot), L1 first, then each adapter."""
    out: list[tuple[ObjectKey, Tier, str, int]] = []
    if tier in (None, Tier.L1):
        for key in manager.l1.resident_keys():
            size = manager.l1.size_of(key)
            if size is not None and (not model_name or key.model_name == model_name):
                out.append((key, Tier.L1, L1_BACKEND, size))
    if tier in (None, Tier.L2):
        for l2 in manager.tiers:
            if backend and backend not in (l2.backend, l2.name):
                continue
            for key, size in l2.index.items():
                if not model_name or key.model_name == model_name:
                    out.append((key, Tier.L2, l2.backend, size))
    return out
