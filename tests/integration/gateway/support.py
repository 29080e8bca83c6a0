"""Helpers of the GatewayService integration tests: a real node behind a real gateway.

A :class:`Stack` is one node as it is deployed: a storage server
(``StorageApp``) and a gateway server (``GatewayApp``) in front of it, both
through the chassis ``create_server`` on free loopback ports, and the typed
synchronous ``GatewayClient`` an engine would use. The storage node is also
reachable directly (the storage tests' :class:`Node`) so a test can look
behind the gateway: which keys are in L1 and L2, how many objects are
read-locked, whether a non-forced delete is refused.

Engines are the storage tests' :class:`Engine` (flash-attn layout, fp16, 64
blocks of 16 tokens, 2 layers, 2 kv heads of 8) in a shared-memory file; the
gateway's chunk is 64 tokens, so a chunk spans four blocks. Tokens are random
per test, so every test has keys of its own, and expected keys are computed
with the same chained blake3 the gateway uses.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.common.hashing import TokenHasher
from kvmesh.common.keys import worker_kv_rank
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.client import GatewayClient
from kvmesh.node.app import NodeApp
from kvmesh.rpc.server import Server
from tests.integration.storage.support import (
    BLOCK_SIZE,
    HEAD_DIM,
    KV_HEADS,
    MODEL,
    NUM_BLOCKS,
    NUM_LAYERS,
    Engine,
    Node,
)

CHUNK = 64
BLOCKS_PER_CHUNK = CHUNK // BLOCK_SIZE
#: One L1 object: ``[2, layers, CHUNK, kv_heads * head_dim]`` fp16.
CHUNK_BYTES = 2 * NUM_LAYERS * CHUNK * KV_HEADS * HEAD_DIM * 2
#: Engine blocks hold this many chunks.
ENGINE_CHUNKS = NUM_BLOCKS // BLOCKS_PER_CHUNK

__all__ = [
    "BLOCKS_PER_CHUNK",
    "BLOCK_SIZE",
    "CHUNK",
    "CHUNK_BYTES",
    "ENGINE_CHUNKS",
    "HEAD_DIM",
    "KV_HEADS",
    "MODEL",
    "NUM_BLOCKS",
    "NUM_LAYERS",
    "Engine",
    "Node",
    "Stack",
]


def prompt(n_chunks: int, extra: int = 0, *, seed: int | None = None) -> list[int]:
    """Random token ids: ``n_chunks`` complete chunks plus ``extra`` trailing tokens."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 50_000, n_chunks * CHUNK + extra)]


def blocks(chunks: Sequence[int] | range, base: int = 0) -> list[int]:
    """Block ids of ``chunks`` when chunk i uses the four blocks from ``base + 4 i``."""
    return [base + c * BLOCKS_PER_CHUNK + b for c in chunks for b in range(BLOCKS_PER_CHUNK)]


def hashes_of(tokens: Sequence[int], n_chunks: int | None = None) -> list[bytes]:
    """The chunk hashes the gateway computes for ``tokens``."""
    return TokenHasher(CHUNK).hash_chunks(np.asarray(tokens, dtype=np.uint32), max_chunks=n_chunks)


def object_keys(
    hashes: Sequence[bytes], *, world_size: int = 1, worker: int = 0, salt: str = ""
) -> list[common_pb2.ObjectKey]:
    """Storage keys of one kv rank, as the gateway derives them."""
    rank = worker_kv_rank(world_size, worker)
    return [
        common_pb2.ObjectKey(chunk_hash=h, model_name=MODEL, kv_rank=rank, cache_salt=salt)
        for h in hashes
    ]


def prange(
    request_id: str,
    tokens: Sequence[int],
    start: int,
    end: int,
    *,
    world_size: int = 1,
    salt: str = "",
    model: str = MODEL,
) -> gateway_pb2.PromptRange:
    """A PromptRange over ``[start, end)`` of ``tokens``."""
    return gateway_pb2.PromptRange(
        request_id=request_id,
        model_name=model,
        world_size=world_size,
        cache_salt=salt,
        token_ids=tokens,
        start_token=start,
        end_token=end,
    )


def code_of(error: grpc.RpcError) -> str:
    """The status code name of a failed call."""
    code = error.code()  # type: ignore[attr-defined]
    return str(code.name)


@dataclass
class Stack:
    """A storage server, a gateway in front of it, and an engine's typed client."""

    node: Node
    gateway: Server
    client: GatewayClient

    @property
    def app(self) -> GatewayApp:
        """The gateway app (read-only peeks at sessions and counters)."""
        app = self.gateway.app
        if isinstance(app, NodeApp):
            return app.gateway
        assert isinstance(app, GatewayApp)
        return app

    def error(self, method: str, request: Any, **kwargs: Any) -> grpc.RpcError:
        """The gRPC error ``GatewayClient.<method>(request)`` fails with."""
        with pytest.raises(grpc.RpcError) as info:
            getattr(self.client, method)(request, **kwargs)
        return info.value

    # -- engine registration -------------------------------------------------------------

    def register(
        self, engine: Engine, *, world_size: int = 1, worker: int = 0, **layout: Any
    ) -> gateway_pb2.RegisterKVCacheResponse:
        """RegisterKVCache of ``engine`` (layout fields overridable)."""
        return self.client.register_kv_cache(
            gateway_pb2.RegisterKVCacheRequest(
                engine_id=engine.engine_id,
                model_name=MODEL,
                world_size=world_size,
                worker_id=worker,
                layout=engine.layout(**layout),
                layers=engine.handles(),
            )
        )

    # -- data path -----------------------------------------------------------------------

    def store(
        self,
        engine: Engine,
        request_id: str,
        tokens: Sequence[int],
        start: int,
        end: int,
        block_ids: Sequence[int],
        *,
        world_size: int = 1,
        salt: str = "",
    ) -> gateway_pb2.StoreResponse:
        """Store ``[start, end)`` of ``tokens`` from ``block_ids``."""
        return self.client.store(
            gateway_pb2.StoreRequest(
                engine_id=engine.engine_id,
                range=prange(request_id, tokens, start, end, world_size=world_size, salt=salt),
                block_ids=block_ids,
            )
        )

    def lookup(
        self,
        request_id: str,
        tokens: Sequence[int],
        *,
        wait_ms: int = 5000,
        world_size: int = 1,
        salt: str = "",
        end: int = 0,
        readers: int = 0,
    ) -> gateway_pb2.LookupResponse:
        """Lookup that waits for completion by default."""
        return self.client.lookup(
            gateway_pb2.LookupRequest(
                request_id=request_id,
                model_name=MODEL,
                world_size=world_size,
                cache_salt=salt,
                token_ids=tokens,
                end_token=end,
                num_kv_readers=readers,
                wait_timeout_ms=wait_ms,
            )
        )

    def retrieve(
        self,
        engine: Engine,
        request_id: str,
        tokens: Sequence[int],
        start: int,
        end: int,
        block_ids: Sequence[int],
        *,
        skip: int = 0,
        world_size: int = 1,
        salt: str = "",
        layers: tuple[int, int] | None = None,
    ) -> gateway_pb2.RetrieveResponse:
        """Retrieve ``[start, end)`` of ``tokens`` into ``block_ids`` (only ``layers``)."""
        request = gateway_pb2.RetrieveRequest(
            engine_id=engine.engine_id,
            range=prange(request_id, tokens, start, end, world_size=world_size, salt=salt),
            block_ids=block_ids,
            skip_first_n_tokens=skip,
        )
        if layers is not None:
            request.layers.start, request.layers.end = layers
        return self.client.retrieve(request)

    def end_session(self, request_id: str) -> gateway_pb2.EndSessionResponse:
        return self.client.end_session(gateway_pb2.EndSessionRequest(request_id=request_id))

    # -- behind the gateway --------------------------------------------------------------

    def locked(self) -> int:
        """Read-locked L1 objects on the node."""
        return self.node.read_locked_objects()

    def l1(self) -> set[bytes]:
        """Chunk hashes resident in the node's L1."""
        return self.node.l1_hashes()

    def l1_bytes(
        self, hashes: Sequence[bytes], *, world_size: int = 1, worker: int = 0
    ) -> list[bytes]:
        """The node's L1 bytes of the resident prefix of ``hashes`` (no lock left behind)."""
        prepared = self.node.call(
            "prepare_retrieve",
            storage_pb2.PrepareRetrieveRequest(
                keys=common_pb2.ChunkKeys(
                    model_name=MODEL,
                    kv_rank=worker_kv_rank(world_size, worker),
                    chunk_hashes=list(hashes),
                ),
                chunk_bytes=CHUNK_BYTES,
            ),
        )
        try:
            return [read_region(slot.region) for slot in prepared.slots]
        finally:
            if prepared.transaction_id:
                self.node.call(
                    "commit_retrieve",
                    storage_pb2.CommitRetrieveRequest(transaction_id=prepared.transaction_id),
                )

    def delete(
        self, keys: Sequence[common_pb2.ObjectKey], *, force: bool = False
    ) -> tuple[int, int]:
        """Storage DeleteKeys on L1; (deleted, skipped)."""
        response = self.node.call(
            "delete_keys",
            storage_pb2.DeleteKeysRequest(keys=list(keys), tier=common_pb2.TIER_L1, force=force),
        )
        return int(response.deleted), int(response.skipped)

    def close(self) -> None:
        self.client.close()
        self.node.close()


# -- shared-memory slots of the engine-driven path ------------------------------------------


def _map(region: common_pb2.SharedMemoryHandle, *, write: bool) -> tuple[mmap.mmap, int]:
    """Map the pages holding ``region``; the mapping and the region's offset in it."""
    start = region.offset_bytes - region.offset_bytes % mmap.ALLOCATIONGRANULARITY
    length = region.offset_bytes + region.size_bytes - start
    fd = os.open(region.path, os.O_RDWR if write else os.O_RDONLY)
    try:
        access = mmap.ACCESS_WRITE if write else mmap.ACCESS_READ
        return mmap.mmap(fd, length, access=access, offset=start), region.offset_bytes - start
    finally:
        os.close(fd)


def read_region(region: common_pb2.SharedMemoryHandle) -> bytes:
    """The bytes of a slot, read through a mapping of its file (as an engine would)."""
    mapping, at = _map(region, write=False)
    with mapping:
        return mapping[at : at + region.size_bytes]


def write_region(region: common_pb2.SharedMemoryHandle, data: bytes) -> None:
    """Write a slot through a mapping of its file (as an engine would)."""
    assert len(data) == region.size_bytes, (len(data), region.size_bytes)
    mapping, at = _map(region, write=True)
    with mapping:
        mapping[at : at + len(data)] = data
