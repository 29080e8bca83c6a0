"""A P2P fleet of real processes: one coordinator, storage nodes without a shared L2.

Every process is ``kvmesh <service>`` (``CliProcess``: a fixed port, so a node
can be SIGKILLed and restarted where its peers and the coordinator know it).
Each node has an engine (a shared-memory KV cache, see
``tests/integration/storage/support.py``) and is driven over a real socket
with the generated stubs. Nodes run with small P2P timeouts so a dead peer
costs seconds, not LMCache's 30 s defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvmesh.api.coordinator.v1 import directory_pb2
from kvmesh.api.storage.v1 import peer_pb2_grpc, storage_pb2, storage_pb2_grpc
from kvmesh.coordinator.client import DirectoryClient
from tests.integration.coordinator.support import CliProcess
from tests.integration.storage.support import (
    CHUNK_TOKENS,
    MODEL,
    Engine,
    blocks_of,
    grid,
    object_keys,
    row,
)
from tests.support.waiting import wait_until

MIB = 1 << 20


@dataclass
class PeerNode:
    """A storage process, its engine, and stubs over one channel."""

    name: str
    proc: CliProcess
    engine: Engine
    channel: grpc.Channel | None = None

    @property
    def target(self) -> str:
        return self.proc.target

    def connect(self) -> None:
        """(Re)open the channel (after a restart)."""
        if self.channel is not None:
            self.channel.close()
        self.channel = grpc.insecure_channel(self.target)

    @property
    def storage(self) -> storage_pb2_grpc.StorageServiceStub:
        assert self.channel is not None
        return storage_pb2_grpc.StorageServiceStub(self.channel)

    @property
    def peer(self) -> peer_pb2_grpc.PeerServiceStub:
        assert self.channel is not None
        return peer_pb2_grpc.PeerServiceStub(self.channel)

    def register(self) -> None:
        self.storage.RegisterEngineMemory(self.engine.register_request(), timeout=30)

    def store(self, hashes: Sequence[bytes], *, salt: str = "", base: int = 0) -> list[int]:
        """StoreChunks of the engine's blocks from ``base``; the outcomes."""
        response = self.storage.StoreChunks(
            storage_pb2.StoreChunksRequest(
                engine_id=self.engine.engine_id,
                keys=row(hashes, salt=salt),
                block_ids=blocks_of(range(len(hashes)), base),
                chunk_tokens=CHUNK_TOKENS,
            ),
            timeout=30,
        )
        return list(response.outcomes)

    def lookup(self, hashes: Sequence[bytes], *, salt: str = "", wait_ms: int = 20_000) -> Any:
        """LookupAndLock (one kv rank), waiting for completion; the response."""
        return self.storage.LookupAndLock(
            storage_pb2.LookupAndLockRequest(
                keys=grid(hashes, salt=salt),
                num_kv_readers=1,
                wait_timeout_ms=wait_ms,
                request_id="p2p-test",
            ),
            timeout=wait_ms / 1000 + 10,
        )

    def retrieve(self, hashes: Sequence[bytes], *, salt: str = "", base: int = 0) -> int:
        """RetrieveChunks into the engine's blocks from ``base``, releasing the lookup locks."""
        response = self.storage.RetrieveChunks(
            storage_pb2.RetrieveChunksRequest(
                engine_id=self.engine.engine_id,
                keys=row(hashes, salt=salt),
                block_ids=blocks_of(range(len(hashes)), base),
                chunk_tokens=CHUNK_TOKENS,
                release_lookup_locks=[True] * len(hashes),
            ),
            timeout=30,
        )
        return int(response.retrieved_chunks)

    def status(self) -> storage_pb2.GetStatusResponse:
        return self.storage.GetStatus(storage_pb2.GetStatusRequest(), timeout=5)

    def read_locked(self) -> int:
        """Read-locked L1 objects right now."""
        return int(self.status().l1.read_locked_objects)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def storage_args(
    tmp_path: Path, shm_root: Path, name: str, coordinator: str, *extra: str
) -> list[str]:
    """Flags of one P2P test node (no shared L2, small L1, short P2P timeouts)."""
    (shm_root / f"{name}-l1").mkdir(parents=True, exist_ok=True)
    return [
        "--log-level",
        "WARNING",
        "--instance-id",
        f"p2p-{name}-{tmp_path.name[-12:]}".replace("_", "-"),
        "--data-dir",
        str(tmp_path / name),
        "--coordinator-target",
        coordinator,
        "--l2",
        "none",
        "--l1-size-bytes",
        str(32 * MIB),
        "--l1-segment-bytes",
        str(8 * MIB),
        "--shm-dir",
        str(shm_root / f"{name}-l1"),
        "--allowed-memory-dir",
        str(shm_root / "engine"),
        "--heartbeat-seconds",
        "0.5",
        "--event-flush-ms",
        "5",
        "--p2p-lookup-timeout",
        "3",
        "--p2p-load-timeout",
        "5",
        "--grace-seconds",
        "0.5",
        "--max-chunks-per-request",
        "64",
        *extra,
    ]


def coordinator_args(tmp_path: Path) -> list[str]:
    return [
        "--log-level",
        "WARNING",
        "--grace-seconds",
        "0.5",
        "--checkpoint-path",
        str(tmp_path / "coordinator.ckpt"),
        "--metadata-path",
        str(tmp_path / "metadata.json"),
        "--checkpoint-interval-seconds",
        "0",
        "--instance-timeout-seconds",
        "3",
        "--heartbeat-interval-seconds",
        "0.5",
    ]


def wait_in_directory(
    coordinator: str, hashes: Sequence[bytes], instance_id: str, *, salt: str = ""
) -> None:
    """Until the coordinator's directory places every key on ``instance_id``."""
    with DirectoryClient(coordinator) as directory:

        def placed() -> bool:
            response = directory.lookup(
                directory_pb2.LookupRequest(
                    keys=directory_pb2.KeyList(keys=object_keys(hashes, salt=salt))
                )
            )
            return all(
                any(p.instance_id == instance_id for p in r.placements) for r in response.results
            )

        wait_until(placed, timeout=20, message="the directory never learned the stored keys")


__all__ = ["MIB", "MODEL", "PeerNode", "coordinator_args", "storage_args", "wait_in_directory"]
