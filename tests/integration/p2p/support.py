"""A P2P fleet of real processes: one coordinator, storage nodes without a shared L2.

Every process is ``kvmesh <service>`` (``CliProcess``: a fixed port, so a node
can be SIGKILLed and restarted where its peers and the coordinator know it).
Each node has an engine (a shared-memory KV cache, see
``tests/integration/storage/support.py``) and is driven over a real socket
with the generated stubs. Nodes run with small P2P timeouts so a dead peer
costs seconds, not LMCache's 30 s defaults.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import directory_pb2
from kvmesh.api.storage.v1 import peer_pb2_grpc, storage_pb2, storage_pb2_grpc
from kvmesh.coordinator.client import DirectoryClient
from tests.integration.coordinator.support import CliProcess
from tests.integration.storage.support import (
    BLOCK_SIZE,
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


class WideEngine:
    """An engine whose chunks are MiB-sized (the small :class:`Engine`'s are 4 KiB).

    Same block size and chunk tokens as ``Engine`` (so ``blocks_of`` and
    PeerNode's store/retrieve apply), wider layers: a prefix of many chunks
    is a stream of many frames, long enough to kill its sender in the middle.
    The bytes are random, so a torn or misplaced chunk never compares equal.
    """

    NUM_LAYERS = 4
    KV_HEADS = 8
    HEAD_DIM = 512
    CHUNK_BYTES = 2 * NUM_LAYERS * CHUNK_TOKENS * KV_HEADS * HEAD_DIM * 2  # 2 MiB

    def __init__(self, directory: Path, engine_id: str, seed: int = 0, num_blocks: int = 128):
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.layer_bytes = 2 * num_blocks * BLOCK_SIZE * self.KV_HEADS * self.HEAD_DIM * 2
        self.path = directory / f"{engine_id}-kv"
        with open(self.path, "wb") as f:
            f.truncate(self.layer_bytes * self.NUM_LAYERS)
        shape = (self.NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, self.KV_HEADS, self.HEAD_DIM)
        self.kv: np.memmap[Any, np.dtype[np.float16]] = np.memmap(
            self.path, dtype=np.float16, mode="r+", shape=shape
        )
        rng = np.random.default_rng(seed)
        raw = np.frombuffer(rng.bytes(self.layer_bytes * self.NUM_LAYERS), dtype=np.float16)
        self.kv[:] = raw.reshape(shape)

    def register_request(self) -> storage_pb2.RegisterEngineMemoryRequest:
        return storage_pb2.RegisterEngineMemoryRequest(
            engine_id=self.engine_id,
            layout=common_pb2.KVLayout(
                kind=common_pb2.KV_LAYOUT_KIND_FLASH_ATTN,
                num_layers=self.NUM_LAYERS,
                num_blocks=self.num_blocks,
                block_size=BLOCK_SIZE,
                kv_heads=self.KV_HEADS,
                head_dim=self.HEAD_DIM,
                dtype=common_pb2.DTYPE_FLOAT16,
            ),
            layers=[
                common_pb2.MemoryHandle(
                    shared_memory=common_pb2.SharedMemoryHandle(
                        path=str(self.path),
                        offset_bytes=i * self.layer_bytes,
                        size_bytes=self.layer_bytes,
                    )
                )
                for i in range(self.NUM_LAYERS)
            ],
        )

    def blocks_bytes(self, blocks: Sequence[int]) -> bytes:
        """The engine's bytes of ``blocks`` (every layer, K and V)."""
        return np.asarray(self.kv[:, :, list(blocks)]).tobytes()

    def fill(self, blocks: Sequence[int], value: float) -> None:
        self.kv[:, :, list(blocks)] = value

    def close(self) -> None:
        del self.kv
        self.path.unlink(missing_ok=True)


class TcpProxy:
    """A loopback TCP forwarder to ``upstream`` whose two directions can be held.

    A test makes a node advertise the proxy's address, so its peers' PeerService
    calls pass here; holding ``to_upstream`` (asker to peer) or ``to_client``
    (peer to asker) freezes a call at a chosen step while everything else (the
    coordinator, the test's own calls to the node) goes on: the bytes wait in
    the proxy and the kernel's buffers, and flow on when the direction opens.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.to_upstream = threading.Event()
        self.to_client = threading.Event()
        self.to_upstream.set()
        self.to_client.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._start(self._accept)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                return  # closed
            upstream.settimeout(None)
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            self._start(self._pump, client, upstream, self.to_upstream)
            self._start(self._pump, upstream, client, self.to_client)

    def _pump(self, src: socket.socket, dst: socket.socket, gate: threading.Event) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                gate.wait()
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (dst, src):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self.to_upstream.set()
        self.to_client.set()
        # A close alone does not wake the accept() blocked on the listener (Linux); a
        # shutdown does, so the accept thread ends now rather than at the join's timeout.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
            threads = list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in threads:
            thread.join(10)


@dataclass
class PeerNode:
    """A storage process, its engine, and stubs over one channel."""

    name: str
    proc: CliProcess
    engine: Engine | WideEngine
    channel: grpc.Channel | None = None
    metrics_port: int = field(default=-1)
    #: The lease of the last lookup (what the next retrieve uses).
    lease_id: str = ""

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
        """LookupAndLock (one kv rank), waiting for completion; the response.

        Its lease is the one the next :meth:`retrieve` uses.
        """
        response = self.storage.LookupAndLock(
            storage_pb2.LookupAndLockRequest(
                keys=grid(hashes, salt=salt),
                num_kv_readers=1,
                wait_timeout_ms=wait_ms,
                request_id="p2p-test",
            ),
            timeout=wait_ms / 1000 + 10,
        )
        self.lease_id = response.prefetch_id
        return response

    def retrieve(self, hashes: Sequence[bytes], *, salt: str = "", base: int = 0) -> int:
        """RetrieveChunks into the engine's blocks from ``base``, releasing the lookup locks."""
        response = self.storage.RetrieveChunks(
            storage_pb2.RetrieveChunksRequest(
                engine_id=self.engine.engine_id,
                keys=row(hashes, salt=salt),
                block_ids=blocks_of(range(len(hashes)), base),
                chunk_tokens=CHUNK_TOKENS,
                lease_id=self.lease_id,
            ),
            timeout=30,
        )
        return int(response.retrieved_chunks)

    def status(self) -> storage_pb2.GetStatusResponse:
        return self.storage.GetStatus(storage_pb2.GetStatusRequest(), timeout=5)

    def read_locked(self) -> int:
        """Read-locked L1 objects right now."""
        return int(self.status().l1.read_locked_objects)

    def delete(self, hashes: Sequence[bytes], *, force: bool = False) -> int:
        """DeleteKeys from L1 (as an eviction would drop them); how many were deleted."""
        response = self.storage.DeleteKeys(
            storage_pb2.DeleteKeysRequest(
                keys=object_keys(hashes), tier=common_pb2.TIER_L1, force=force
            ),
            timeout=10,
        )
        return int(response.deleted)

    def metric(self, name: str) -> float | None:
        """One sample of the node's /metrics (started with ``--metrics-port``), or None."""
        assert self.metrics_port > 0, "the node was started without --metrics-port"
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        return None

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


def read_spans(spans_file: Path) -> list[dict[str, Any]]:
    """Every span the fleet exported so far (KVMESH_TRACE_FILE); a line being
    appended right now is left for the next read."""
    if not spans_file.exists():
        return []
    spans = []
    for line in spans_file.read_text().splitlines():
        try:
            spans.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a batch being appended right now
    return spans


def fetch_spans(spans_file: Path) -> list[dict[str, Any]]:
    """The ``kvmesh.p2p.fetch`` spans the fleet exported so far."""
    return [s for s in read_spans(spans_file) if s.get("name") == "kvmesh.p2p.fetch"]


__all__ = [
    "MIB",
    "MODEL",
    "PeerNode",
    "TcpProxy",
    "WideEngine",
    "coordinator_args",
    "fetch_spans",
    "read_spans",
    "storage_args",
    "wait_in_directory",
]
