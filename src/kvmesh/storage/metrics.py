"""A storage node's Prometheus series: its status flattened, and what each series reads."""

from __future__ import annotations

from typing import Any

from kvmesh.rpc.metrics import Series
from kvmesh.storage.core.node import StorageNode
from kvmesh.storage.events.emitter import CacheEventEmitter


def flat_stats(node: StorageNode, emitter: CacheEventEmitter | None) -> dict[str, Any]:
    """The node's status flattened for Prometheus series."""
    status = node.status()
    l1 = status["l1"]
    out: dict[str, Any] = {
        "l1_used_bytes": l1.get("used_bytes", 0),
        "l1_capacity_bytes": l1.get("capacity_bytes", 0),
        "l1_mapped_bytes": l1.get("committed_bytes", 0),
        "l1_resident_objects": l1.get("resident_objects", 0),
        "l1_segments": l1.get("segments", 0),
        "l1_growth_waits": l1.get("growth_waits", 0),
        "l1_growth_wait_max_seconds": l1.get("growth_wait_max_s", 0.0),
        "l1_growths_deferred": l1.get("loop_growths_deferred", 0),
        "l1_read_locked_objects": l1.get("read_locked_objects", 0),
        "l1_bytes_by_salt": node.manager.l1.bytes_by_salt(),
        "active_prefetches": status["active_prefetches"],
        "lookup_leases": status["lookup_leases"],
        "lease_locks": status["lease_locks"],
        "leases_expired": status["lease_stats"].expired,
        "leases_ended_by_owner": status["lease_stats"].ended_by_owner,
        "lease_locks_lapsed": status["lease_stats"].lapsed_locks,
        "waiting_calls": status["waiting_calls"],
        "engines": len(status["engines"]),
        "l2_used_bytes": {t["name"]: t["index_bytes"] for t in status["l2"]},
        "l2_objects": {t["name"]: t["index_objects"] for t in status["l2"]},
        "l2_healthy": {t["name"]: 1 if t["healthy"] else 0 for t in status["l2"]},
        "l2_stored_keys": {t["name"]: t["stored_keys"] for t in status["l2"]},
        "l2_loaded_keys": {t["name"]: t["loaded_keys"] for t in status["l2"]},
        "l2_store_failed_keys": {t["name"]: t["store_failed_keys"] for t in status["l2"]},
    }
    copies = status["copies"]
    out["copies"] = {d: t["copies"] for d, t in copies.items()}
    out["copy_bytes"] = {d: t["bytes"] for d, t in copies.items()}
    out["copy_seconds"] = {d: t["seconds"] for d, t in copies.items()}
    for section in ("eviction", "store", "prefetch"):
        for name, value in status.get(section, {}).items():
            if isinstance(value, bool | int | float):
                out[f"{section}_{name}"] = value
    if emitter is not None:
        stats = emitter.stats()
        for name in ("batches_acked", "batches_dropped", "reconnects", "window_depth"):
            out[f"emitter_{name}"] = getattr(stats, name, 0)
        out["emitter_connected"] = 1 if getattr(stats, "connected", False) else 0
    return out


#: The node's Prometheus series, read off :func:`flat_stats`.
SERIES = [
    Series(
        "kvmesh_storage_copies",
        "Copies the node made between an engine's KV memory and L1, by direction "
        "(store: engine to L1, retrieve: L1 to engine).",
        "copies",
        "counter",
        label="direction",
    ),
    Series(
        "kvmesh_storage_copy_bytes",
        "Bytes those copies moved, by direction.",
        "copy_bytes",
        "counter",
        label="direction",
    ),
    Series(
        "kvmesh_storage_copy_seconds",
        "Time those copies took on the copy threads, by direction (bytes over seconds is "
        "the copy's throughput).",
        "copy_seconds",
        "counter",
        label="direction",
    ),
    Series("kvmesh_storage_l1_used_bytes", "L1 bytes in use.", "l1_used_bytes"),
    Series("kvmesh_storage_l1_capacity_bytes", "Configured L1 size.", "l1_capacity_bytes"),
    Series("kvmesh_storage_l1_mapped_bytes", "L1 bytes mapped so far.", "l1_mapped_bytes"),
    Series("kvmesh_storage_l1_objects", "Resident L1 objects.", "l1_resident_objects"),
    Series("kvmesh_storage_l1_segments", "L1 segments mapped so far.", "l1_segments"),
    Series(
        "kvmesh_storage_l1_growth_waits",
        "Store calls that waited for L1 to grow (the growth runs off the event loop).",
        "l1_growth_waits",
        "counter",
    ),
    Series(
        "kvmesh_storage_l1_growth_wait_max_seconds",
        "Longest wait of one store call for an L1 growth since start.",
        "l1_growth_wait_max_seconds",
    ),
    Series(
        "kvmesh_storage_l1_growths_deferred",
        "Reservations on the event loop that left growing to the background grower.",
        "l1_growths_deferred",
        "counter",
    ),
    Series(
        "kvmesh_storage_l1_read_locked_objects",
        "L1 objects with read locks.",
        "l1_read_locked_objects",
    ),
    Series(
        "kvmesh_storage_l1_salt_bytes",
        "L1 bytes per cache salt.",
        "l1_bytes_by_salt",
        label="cache_salt",
    ),
    Series("kvmesh_storage_active_prefetches", "Prefetches in flight.", "active_prefetches"),
    Series(
        "kvmesh_storage_lookups_by_index",
        "Lookups whose miss the L2 indexes answered at once (no adapter asked, no worker).",
        "prefetch_completed_by_index",
        "counter",
    ),
    Series("kvmesh_storage_lookup_leases", "Lookup leases alive.", "lookup_leases"),
    Series("kvmesh_storage_lease_locks", "Read locks held by lookup leases.", "lease_locks"),
    Series(
        "kvmesh_storage_leases_expired",
        "Lookup leases ended by their TTL (nobody ended them).",
        "leases_expired",
        "counter",
    ),
    Series(
        "kvmesh_storage_leases_ended_by_owner",
        "Lookup leases ended because the gateway reaped the engine that looked up.",
        "leases_ended_by_owner",
        "counter",
    ),
    Series(
        "kvmesh_storage_lease_locks_lapsed",
        "Read locks a lookup lease still held when they lapsed in L1 (dropped unreleased; "
        "the node's sweep fell behind).",
        "lease_locks_lapsed",
        "counter",
    ),
    Series(
        "kvmesh_storage_waiting_calls",
        "Calls waiting for a prefetch (they hold no thread).",
        "waiting_calls",
    ),
    Series("kvmesh_storage_engines", "Registered engines.", "engines"),
    Series(
        "kvmesh_storage_l2_used_bytes", "L2 bytes per adapter.", "l2_used_bytes", label="adapter"
    ),
    Series("kvmesh_storage_l2_objects", "L2 objects per adapter.", "l2_objects", label="adapter"),
    Series(
        "kvmesh_storage_l2_healthy", "1 when the adapter is usable.", "l2_healthy", label="adapter"
    ),
    Series(
        "kvmesh_storage_l2_stored_keys",
        "Keys written to L2.",
        "l2_stored_keys",
        "counter",
        label="adapter",
    ),
    Series(
        "kvmesh_storage_l2_loaded_keys",
        "Keys loaded from L2.",
        "l2_loaded_keys",
        "counter",
        label="adapter",
    ),
    Series(
        "kvmesh_storage_l2_store_failed_keys",
        "Failed L2 writes.",
        "l2_store_failed_keys",
        "counter",
        label="adapter",
    ),
    Series(
        "kvmesh_storage_l1_evicted_keys",
        "Keys evicted from L1.",
        "eviction_l1_evicted_keys",
        "counter",
    ),
    Series(
        "kvmesh_storage_l2_evicted_keys",
        "Keys evicted from L2.",
        "eviction_l2_evicted_keys",
        "counter",
    ),
    Series(
        "kvmesh_storage_emitter_batches_acked",
        "Event batches acked.",
        "emitter_batches_acked",
        "counter",
    ),
    Series(
        "kvmesh_storage_emitter_batches_dropped",
        "Event batches dropped (gap).",
        "emitter_batches_dropped",
        "counter",
    ),
    Series(
        "kvmesh_storage_emitter_connected", "1 while the event stream is up.", "emitter_connected"
    ),
]
