"""P2P on the operator surface of one node: Prometheus series and GetStatus.

An in-process storage server (no coordinator: it serves peers but does not
fetch) on a real socket; the test reads a lease like a peer would.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc

from kvmesh.api.storage.v1 import peer_pb2, peer_pb2_grpc, storage_pb2, storage_pb2_grpc
from kvmesh.storage.app import StorageApp
from kvmesh.storage.config import StorageConfig
from tests.integration.p2p.support import MIB
from tests.integration.storage.support import (
    CHUNK_BYTES,
    CHUNK_TOKENS,
    Engine,
    blocks_of,
    grid,
    new_hashes,
    row,
)
from tests.support.harness import server_thread


def test_served_traffic_shows_in_metrics_and_status(tmp_path: Path, shm_root: Path) -> None:
    (shm_root / "l1").mkdir()
    engine = Engine(shm_root / "engine", "engine-m")
    instance = f"p2p-metrics-{uuid.uuid4().hex[:8]}"
    config = StorageConfig(
        port=0,
        metrics_port=-1,
        grace_seconds=0.5,
        instance_id=instance,
        data_dir=str(tmp_path / "node"),
        l1_size_bytes=32 * MIB,
        l1_segment_bytes=8 * MIB,
        shm_dir=str(shm_root / "l1"),
        allowed_memory_dir=str(shm_root / "engine"),
        l2=["none"],
    )
    try:
        with server_thread() as thread:
            server = thread.start(config, StorageApp)
            with grpc.insecure_channel(server.target) as channel:
                storage = storage_pb2_grpc.StorageServiceStub(channel)
                peer = peer_pb2_grpc.PeerServiceStub(channel)
                storage.RegisterEngineMemory(engine.register_request(), timeout=10)
                hashes = new_hashes(3)
                storage.StoreChunks(
                    storage_pb2.StoreChunksRequest(
                        engine_id=engine.engine_id,
                        keys=row(hashes),
                        block_ids=blocks_of(range(3)),
                        chunk_tokens=CHUNK_TOKENS,
                    ),
                    timeout=10,
                )
                lease = peer.LockPrefix(peer_pb2.LockPrefixRequest(keys=grid(hashes)), timeout=10)
                frames = list(
                    peer.ReadChunks(peer_pb2.ReadChunksRequest(lease_id=lease.lease_id), timeout=10)
                )
                assert sum(len(f.data) for f in frames) == 3 * CHUNK_BYTES
                status = storage.GetStatus(storage_pb2.GetStatusRequest(), timeout=5).p2p

            assert not status.enabled  # no coordinator: serves peers, fetches nothing
            assert status.peers == -1  # and knows no members
            assert status.transport == "tcp-stream"
            assert status.advertise_address == server.target
            assert (status.leases_granted, status.served_chunks) == (1, 3)
            assert status.served_bytes == 3 * CHUNK_BYTES
            labels = {"instance_id": instance}
            sample = server.registry.get_sample_value
            assert sample("kvmesh_storage_p2p_served_chunks_total", labels) == 3
            assert sample("kvmesh_storage_p2p_served_bytes_total", labels) == 3 * CHUNK_BYTES
            assert sample("kvmesh_storage_p2p_leases_granted_total", labels) == 1
            assert sample("kvmesh_storage_p2p_active_leases", labels) == 0
            assert sample("kvmesh_storage_p2p_peers", labels) == -1
            assert sample("kvmesh_storage_p2p_enabled", labels) == 0
            assert sample("kvmesh_storage_p2p_fetched_chunks_total", labels) == 0
            assert sample("kvmesh_storage_p2p_misses_total", labels) == 0
            assert sample("kvmesh_storage_p2p_received_bytes_total", labels) == 0
    finally:
        engine.close()
