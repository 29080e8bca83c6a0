"""Read models of memory and quotas, computed from several components at once.

Pure functions over the instance registry, the declared capacities, the
usage view and the quotas; :class:`~.coordinator.Coordinator` exposes them
as ``instance_usage``, ``fleet_usage``, ``quota_status`` and
``list_quota_status``.
"""

from __future__ import annotations

from kvmesh.common.events import Tier

from .capacity import ServerConfigRegistry
from .membership import InstanceRegistry
from .quotas import QuotaManager
from .types import (
    FleetMemoryStatus,
    InstanceMemoryStatus,
    ModuleMemoryStatus,
    QuotaListing,
    QuotaStatus,
)
from .usage import CacheUsageManager


def module_status(
    tier: Tier, backend: str, shared: bool, used: int, capacity: int
) -> ModuleMemoryStatus:
    """One compartment's used and declared bytes (ratio None when nothing was declared)."""
    ratio = used / capacity if capacity > 0 else None
    return ModuleMemoryStatus(tier, backend, shared, used, capacity, ratio)


def instance_status(
    registry: InstanceRegistry,
    capacity: ServerConfigRegistry,
    usage: CacheUsageManager,
    instance_id: str,
) -> InstanceMemoryStatus | None:
    """The private compartments of one node; None when it is unregistered, empty and undeclared."""
    registered = registry.contains(instance_id)
    declared = capacity.get(instance_id)
    used = usage.get_owner_bytes(instance_id)
    if not registered and not declared and not used:
        return None
    caps = {(m.tier, m.backend): m.capacity_bytes for m in declared if not m.shared}
    modules = tuple(
        module_status(t, b, False, used.get((t, b), 0), caps.get((t, b), 0))
        for t, b in sorted(set(caps) | set(used))
    )
    return InstanceMemoryStatus(instance_id, registered, bool(declared), modules)


def fleet_status(
    registry: InstanceRegistry, capacity: ServerConfigRegistry, usage: CacheUsageManager
) -> FleetMemoryStatus:
    """Every node that is registered, holds bytes or declared capacity, plus shared pools."""
    declarations = capacity.get_all()
    ids = (
        {i.instance_id for i in registry.all_instances()}
        | {o for o in usage.owners() if o}
        | set(declarations)
    )
    instances = tuple(
        st
        for iid in sorted(ids)
        if (st := instance_status(registry, capacity, usage, iid)) is not None
    )
    # A shared pool's capacity counts only when every declaring node agrees.
    shared_caps: dict[tuple[Tier, str], set[int]] = {}
    for mods in declarations.values():
        for m in mods:
            if m.shared:
                shared_caps.setdefault((m.tier, m.backend), set()).add(m.capacity_bytes)
    shared_used = usage.get_owner_bytes("")
    shared = tuple(
        module_status(
            t,
            b,
            True,
            shared_used.get((t, b), 0),
            next(iter(caps)) if len(caps := shared_caps.get((t, b), set())) == 1 else 0,
        )
        for t, b in sorted(set(shared_caps) | set(shared_used))
    )
    return FleetMemoryStatus(instances, shared)


def quota_status(
    usage: CacheUsageManager, quotas: QuotaManager, cache_salt: str, tier: Tier
) -> QuotaStatus:
    """Quota (L2 only) and usage of one salt."""
    used = usage.get_salt_bytes(tier, cache_salt)
    if tier != Tier.L2:
        return QuotaStatus(cache_salt, tier, None, False, used)
    exists = quotas.has_quota(cache_salt)
    limit = quotas.get_limit_bytes(cache_salt) if exists else None
    return QuotaStatus(cache_salt, tier, limit, exists, used)


def quota_listing(usage: CacheUsageManager, quotas: QuotaManager, tier: Tier) -> QuotaListing:
    """Status of every salt with usage on ``tier`` or (L2) a quota, sorted by salt."""
    salts = set(usage.get_bytes_by_salt(tier))
    if tier == Tier.L2:
        salts |= set(quotas.list_quotas())
    return QuotaListing(
        tier,
        usage.get_total_bytes(tier),
        tuple(quota_status(usage, quotas, s, tier) for s in sorted(salts)),
    )
