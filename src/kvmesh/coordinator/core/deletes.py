"""Operator deletes: which node gets which keys, for which tier.

:func:`delete_keys` expands keys across object groups, leaves pinned keys
alone (unless forced, for L2), groups the rest by destination (one node, or
every live node holding a copy, naming the copy's backend) and sends the
groups through the eviction controller's dispatcher. The nodes report the
effects later as DELETE events. :class:`~.coordinator.Coordinator` exposes
it as ``delete_keys`` and ``delete_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.common.errors import NotFound, Unavailable
from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey

from .components import CoreComponents
from .types import DeleteKeysResult, DeleteRequest


def require_instance(core: CoreComponents, instance_id: str) -> None:
    """NotFound when ``instance_id`` is set and not registered."""
    if instance_id and not core.registry.contains(instance_id):
        raise NotFound(f"unknown instance {instance_id}", metadata={"instance_id": instance_id})


def delete_keys(
    core: CoreComponents,
    keys: Sequence[ObjectKey],
    *,
    instance_id: str = "",
    tier: Tier | None = None,
    force: bool = False,
) -> DeleteKeysResult:
    """Delete keys (and their other object groups) through the nodes' command streams.

    See :meth:`~.coordinator.Coordinator.delete_keys` for the contract.
    """
    require_instance(core, instance_id)
    tiers = (Tier.L1, Tier.L2) if tier is None else (tier,)
    expanded = [k for ks in core.directory.get_keys_across_object_groups(keys) for k in ks]
    pin_skipped = 0
    targets = expanded
    if Tier.L2 in tiers and not force:
        targets = core.pins.filter_unpinned(expanded)
        pin_skipped = len(expanded) - len(targets)
    requests: list[DeleteRequest] = []
    for t in tiers:
        groups: dict[tuple[str, str], list[ObjectKey]] = {}
        if instance_id:
            if targets:
                groups[(instance_id, "")] = list(targets)
        else:
            for key in targets:
                ck = core.spaces.find_key(key)
                if ck is None:
                    continue
                for dest in core.directory.delete_targets(ck, t, core.registry.contains):
                    groups.setdefault(dest, []).append(key)
        requests.extend(core.eviction.send_deletes(groups, t, force=force))
    if instance_id and requests and not any(r.accepted for r in requests):
        raise Unavailable(
            f"instance {instance_id} did not accept the delete (is its event stream open?)",
            metadata={"instance_id": instance_id},
        )
    if force and Tier.L2 in tiers and core.pins.drop_pins(expanded):
        core.metadata.save()
    dispatched = sum(len(r.keys) for r in requests if r.accepted)
    return DeleteKeysResult(len(keys), dispatched, pin_skipped, tuple(requests))
