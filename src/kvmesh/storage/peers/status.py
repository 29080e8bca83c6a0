"""P2P counters for GetStatus (PeerStatus) and for Prometheus (``kvmesh_storage_p2p_*``)."""

from __future__ import annotations

from typing import Any

from kvmesh.api.storage.v1 import peer_pb2
from kvmesh.rpc.metrics import Series
from kvmesh.storage.core.peer.fetch import PeerFetcher
from kvmesh.storage.core.peer.leases import PeerLeases
from kvmesh.storage.peers.dataplane import PeerDataPlane

SERIES = [
    Series("kvmesh_storage_p2p_enabled", "1 when misses are fetched from peers.", "p2p_enabled"),
    Series(
        "kvmesh_storage_p2p_peers",
        "Other nodes in the membership listing this node uses now (-1: none cached).",
        "p2p_peers",
    ),
    Series(
        "kvmesh_storage_p2p_fetches",
        "Fetches sent to a peer (a lock was asked).",
        "p2p_fetches",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_fetched_chunks",
        "Chunks fetched from peers into L1.",
        "p2p_fetched_chunks",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_fetched_bytes",
        "Bytes fetched from peers into L1.",
        "p2p_fetched_bytes",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_fetch_failures",
        "P2P fetches that failed or ended short.",
        "p2p_fetch_failures",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_directory_lookups",
        "Directory lookups for P2P.",
        "p2p_directory_lookups",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_joined_fetches",
        "Lookups that joined a running fetch of the same keys.",
        "p2p_joined_fetches",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_misses",
        "P2P fetches that ended as a clean miss (no live peer held the keys, or it locked none).",
        "p2p_misses",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_received_bytes",
        "Bytes of chunk frames received from peers, whole chunks or not.",
        "p2p_received_bytes",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_leases_granted",
        "Prefixes locked for peers.",
        "p2p_leases_granted",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_leases_expired",
        "Peer leases ended by their TTL.",
        "p2p_leases_expired",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_served_chunks",
        "Chunks streamed to peers.",
        "p2p_served_chunks",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_served_bytes", "Bytes streamed to peers.", "p2p_served_bytes", "counter"
    ),
    Series("kvmesh_storage_p2p_active_leases", "Peer leases alive now.", "p2p_active_leases"),
    Series(
        "kvmesh_storage_p2p_data_streams",
        "Streams served over the TCP data plane.",
        "p2p_data_streams",
        "counter",
    ),
    Series(
        "kvmesh_storage_p2p_data_refused",
        "Data plane connections refused (malformed request, lease not found, too busy).",
        "p2p_data_refused",
        "counter",
    ),
]


def flat_stats(
    leases: PeerLeases, fetcher: PeerFetcher | None, data_plane: PeerDataPlane | None = None
) -> dict[str, Any]:
    """The P2P counters as ``p2p_*`` values (SERIES's keys)."""
    out: dict[str, Any] = {"p2p_enabled": 1 if fetcher is not None else 0}
    fetched = fetcher.stats() if fetcher is not None else {}
    out["p2p_peers"] = int(fetched.get("peers", -1))
    for name in (
        "fetches",
        "fetched_chunks",
        "fetched_bytes",
        "fetch_failures",
        "directory_lookups",
        "joined_fetches",
        "misses",
        "received_bytes",
    ):
        out[f"p2p_{name}"] = int(fetched.get(name, 0))
    for name, value in leases.stats().items():
        out[f"p2p_{name}"] = int(value)
    plane = data_plane.stats() if data_plane is not None else {}
    for name in ("data_streams", "data_refused"):
        out[f"p2p_{name}"] = int(plane.get(name, 0))
    return out


def peer_status(
    leases: PeerLeases,
    fetcher: PeerFetcher | None,
    advertise_address: str,
    *,
    transport: str,
    data_port: int,
) -> peer_pb2.PeerStatus:
    """GetStatus's ``p2p`` field."""
    stats = flat_stats(leases, fetcher)
    return peer_pb2.PeerStatus(
        enabled=fetcher is not None,
        transport=transport,
        data_port=data_port,
        peers=stats["p2p_peers"],
        advertise_address=advertise_address,
        fetches=stats["p2p_fetches"],
        fetched_chunks=stats["p2p_fetched_chunks"],
        fetched_bytes=stats["p2p_fetched_bytes"],
        fetch_failures=stats["p2p_fetch_failures"],
        directory_lookups=stats["p2p_directory_lookups"],
        leases_granted=stats["p2p_leases_granted"],
        served_chunks=stats["p2p_served_chunks"],
        served_bytes=stats["p2p_served_bytes"],
        active_leases=stats["p2p_active_leases"],
        leases_expired=stats["p2p_leases_expired"],
        joined_fetches=stats["p2p_joined_fetches"],
        misses=stats["p2p_misses"],
        received_bytes=stats["p2p_received_bytes"],
    )
