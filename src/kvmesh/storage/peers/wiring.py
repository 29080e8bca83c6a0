"""A storage node's P2P parts, built from its config: what the app wires in.

Always: the PeerService (this node serves its prefixes to peers), and unless
``p2p_data_port`` is -1 the TCP data plane that sends their bytes. With a
coordinator and ``p2p`` on (the default): the fetcher, handed to the prefetch
controller as its peer source, so local L1 and L2 misses are fetched from
peers found in the coordinator's directory.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from prometheus_client.registry import Collector

from kvmesh.api.storage.v1 import peer_pb2
from kvmesh.rpc.metrics import StatsCollector
from kvmesh.rpc.server import ServiceBinding
from kvmesh.storage.config import StorageConfig, split_advertise_address
from kvmesh.storage.core.node import StorageNode
from kvmesh.storage.core.peer.fetch import FetchSettings, PeerFetcher
from kvmesh.storage.core.peer.leases import PeerLeases
from kvmesh.storage.core.peer.ports import GRPC_STREAM, TCP_STREAM
from kvmesh.storage.peers.dataplane import PeerDataPlane
from kvmesh.storage.peers.malloc import keep_large_allocations
from kvmesh.storage.peers.servicer import PeerServicer, add_peer_service
from kvmesh.storage.peers.status import SERIES, flat_stats, peer_status

SERVICE_NAME = "kvmesh.storage.v1.PeerService"


class PeerWiring:
    """The PeerService, and (with a coordinator) the P2P fetcher of one node."""

    def __init__(
        self, config: StorageConfig, node: StorageNode, instance_id: str, incarnation: int
    ) -> None:
        self.config = config
        # Frames are MiB-sized buffers; keep them warm in the heap (see the module).
        keep_large_allocations()
        self.leases = PeerLeases(
            node,
            instance_id=instance_id,
            incarnation=incarnation,
            default_ttl_s=config.p2p_lease_ttl,
        )
        self.servicer = PeerServicer(self.leases)
        self.data_plane: PeerDataPlane | None = None
        if config.p2p_data_port >= 0:
            self.data_plane = PeerDataPlane(
                self.leases,
                config.host,
                config.p2p_data_port,
                max_streams=config.p2p_max_streams,
            )
        self.advertise_address = config.advertise_address
        self.fetcher: PeerFetcher | None = None
        if config.coordinator_target and config.p2p:
            from kvmesh.storage.peers.links import CoordinatorPeerDirectory, GrpcPeerLink

            directory = CoordinatorPeerDirectory(
                config.coordinator_target, refresh_s=config.p2p_membership_refresh
            )
            # FindSegments also finds the segments other nodes hold (fetched by P2P).
            node.segments.fleet = directory
            self.fetcher = PeerFetcher(
                node.manager.l1,
                directory,
                GrpcPeerLink(
                    instance_id,
                    max_message_bytes=config.max_message_bytes,
                    frame_bytes=config.p2p_frame_bytes,
                ),
                instance_id=instance_id,
                settings=FetchSettings(
                    lookup_timeout_s=config.p2p_lookup_timeout,
                    load_timeout_s=config.p2p_load_timeout,
                    max_in_flight=config.p2p_max_in_flight,
                ),
            )
            node.manager.prefetch.set_peer_source(self.fetcher)

    def advertise(self, bound_address: str) -> str:
        """The storage address registered with the coordinator (peers dial it).

        The configured ``advertise_address``; without a port there, the bound one.
        """
        if not self.advertise_address:
            self.advertise_address = bound_address
        else:
            host, port = split_advertise_address(self.advertise_address)
            if port is None:
                bound_port = bound_address.rpartition(":")[2]
                shown = f"[{host}]" if ":" in host else host
                self.advertise_address = f"{shown}:{bound_port}"
        return self.advertise_address

    @property
    def transport(self) -> str:
        """How this node serves chunk bytes to peers."""
        return TCP_STREAM if self.data_plane is not None else GRPC_STREAM

    async def start(self) -> None:
        """Open the data plane (before the node is registered: LockPrefix names its port)."""
        if self.data_plane is not None:
            self.servicer.data_port = await self.data_plane.start()

    def binding(self) -> ServiceBinding:
        """PeerService on the node's gRPC server."""

        def add(server: grpc.aio.Server) -> None:
            add_peer_service(self.servicer, server)

        return ServiceBinding(SERVICE_NAME, add)

    def collector(self, const_labels: Mapping[str, str]) -> Collector:
        """``kvmesh_storage_p2p_*`` series."""
        return StatsCollector(
            lambda: flat_stats(self.leases, self.fetcher, self.data_plane),
            SERIES,
            const_labels=dict(const_labels),
        )

    def status(self) -> peer_pb2.PeerStatus:
        """GetStatus's ``p2p`` field."""
        return peer_status(
            self.leases,
            self.fetcher,
            self.advertise_address,
            transport=self.transport,
            data_port=self.servicer.data_port,
        )

    async def close(self) -> None:
        """Stop the data plane's streams, then release every lease.

        (The fetcher closes with the prefetch controller.)
        """
        if self.data_plane is not None:
            await self.data_plane.close()
        self.leases.close()
