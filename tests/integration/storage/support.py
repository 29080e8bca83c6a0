"""Helpers of the StorageService integration tests: a real node, an engine, keys.

A :class:`Node` is a real storage server (``StorageApp`` through the chassis
``create_server``) on a free loopback port, driven with the real typed
asyncio ``StorageClient``. The client lives on the server thread's loop
(a ``grpc.aio`` channel belongs to the loop that created it), so every call
is ``thread.run(client.method(request))`` from the synchronous test.

An :class:`Engine` is an inference engine's paged KV cache as the CPU data
path sees it: one shared-memory file under the node's allowed directory,
flash-attn layout ``[2, num_blocks, block_size, kv_heads, head_dim]`` per
layer, fp16, filled with random values. Tests compare its bytes and the L1
bytes (read through PrepareRetrieve, i.e. through the node) against numpy
expectations computed from the engine array.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.node.app import NodeApp
from kvmesh.rpc.server import Server
from kvmesh.storage.app import StorageApp
from kvmesh.storage.client import StorageClient
from tests.support.harness import ServerThread
from tests.support.waiting import wait_until

T = TypeVar("T")

# Engine geometry: small, so that a test moves kilobytes, but every dimension > 1
# so a transposition or an off-by-one block shows up as different bytes.
NUM_LAYERS = 2
NUM_BLOCKS = 64
BLOCK_SIZE = 16
KV_HEADS = 2
HEAD_DIM = 8
CHUNK_TOKENS = 32  # two blocks per chunk
BLOCKS_PER_CHUNK = CHUNK_TOKENS // BLOCK_SIZE
LAYER_BYTES = 2 * NUM_BLOCKS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2
CHUNK_BYTES = 2 * NUM_LAYERS * CHUNK_TOKENS * KV_HEADS * HEAD_DIM * 2
MODEL = "test/model"

STORED = storage_pb2.STORE_OUTCOME_STORED
ALREADY = storage_pb2.STORE_OUTCOME_ALREADY_CACHED


class Engine:
    """One engine's paged KV cache in a shared-memory file (flash-attn, fp16)."""

    def __init__(self, directory: Path, engine_id: str, seed: int = 0) -> None:
        self.engine_id = engine_id
        self.path = directory / f"{engine_id}-kv"
        with open(self.path, "wb") as f:
            f.truncate(LAYER_BYTES * NUM_LAYERS)
        shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.kv: np.memmap[Any, np.dtype[np.float16]] = np.memmap(
            self.path, dtype=np.float16, mode="r+", shape=shape
        )
        rng = np.random.default_rng(seed)
        self.kv[:] = rng.standard_normal(shape).astype(np.float16)

    def layout(self, **overrides: Any) -> common_pb2.KVLayout:
        """The engine's layout message (fields overridable for bad-input tests)."""
        fields: dict[str, Any] = {
            "kind": common_pb2.KV_LAYOUT_KIND_FLASH_ATTN,
            "num_layers": NUM_LAYERS,
            "num_blocks": NUM_BLOCKS,
            "block_size": BLOCK_SIZE,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": common_pb2.DTYPE_FLOAT16,
        }
        fields.update(overrides)
        return common_pb2.KVLayout(**fields)

    def handles(
        self, path: str | None = None, size_bytes: int = LAYER_BYTES, offset: int = 0
    ) -> list[common_pb2.MemoryHandle]:
        """One shared-memory handle per layer (layer i at ``offset + i * LAYER_BYTES``)."""
        return [
            common_pb2.MemoryHandle(
                shared_memory=common_pb2.SharedMemoryHandle(
                    path=path or str(self.path),
                    offset_bytes=offset + i * LAYER_BYTES,
                    size_bytes=size_bytes,
                )
            )
            for i in range(NUM_LAYERS)
        ]

    def register_request(self, **overrides: Any) -> storage_pb2.RegisterEngineMemoryRequest:
        """A valid RegisterEngineMemoryRequest for this engine."""
        return storage_pb2.RegisterEngineMemoryRequest(
            engine_id=overrides.pop("engine_id", self.engine_id),
            layout=overrides.pop("layout", self.layout()),
            layers=overrides.pop("layers", self.handles()),
        )

    def gateway_request(self) -> gateway_pb2.RegisterKVCacheRequest:
        """The gateway's RegisterKVCacheRequest for this engine (one worker of one)."""
        return gateway_pb2.RegisterKVCacheRequest(
            engine_id=self.engine_id,
            model_name=MODEL,
            world_size=1,
            worker_id=0,
            layout=self.layout(),
            layers=self.handles(),
        )

    def snapshot(self) -> np.ndarray[Any, Any]:
        """A copy of every byte of the engine's KV cache."""
        return np.array(self.kv, copy=True)

    def chunk(self, blocks: Sequence[int]) -> bytes:
        """The L1 chunk format of ``blocks``: ``[2, layers, tokens, kv_heads*head_dim]``."""
        picked = np.asarray(self.kv[:, :, list(blocks)])  # [L, 2, nb, BS, H, D]
        tokens = len(blocks) * BLOCK_SIZE
        return picked.transpose(1, 0, 2, 3, 4, 5).reshape(2, NUM_LAYERS, tokens, -1).tobytes()

    def blocks_bytes(self, blocks: Sequence[int]) -> bytes:
        """The engine's bytes of ``blocks`` (every layer, K and V), to compare regions."""
        return np.asarray(self.kv[:, :, list(blocks)]).tobytes()

    def fill(self, blocks: Sequence[int], value: float) -> None:
        """Overwrite ``blocks`` with a constant (a sentinel a copy must change, or not)."""
        self.kv[:, :, list(blocks)] = value

    def close(self) -> None:
        """Drop the mapping and remove the file."""
        del self.kv
        self.path.unlink(missing_ok=True)


async def store_and_read_back(
    address: str, engine: Engine, keys: Any, blocks: Sequence[int]
) -> bytes:
    """Register ``engine`` with the node at ``address``, store ``blocks`` under ``keys``,
    overwrite them, retrieve them: the engine's bytes of ``blocks`` after the retrieve."""
    client = StorageClient(address)
    try:
        await client.register_engine_memory(engine.register_request(), timeout=60)
        chunks = {"engine_id": engine.engine_id, "keys": keys, "block_ids": list(blocks),
                  "chunk_tokens": CHUNK_TOKENS}  # fmt: skip
        stored = await client.store_chunks(storage_pb2.StoreChunksRequest(**chunks), timeout=30)
        assert set(stored.outcomes) == {STORED}
        engine.fill(blocks, 0.0)  # the retrieve must bring the bytes back
        await client.retrieve_chunks(storage_pb2.RetrieveChunksRequest(**chunks), timeout=30)
        return engine.blocks_bytes(blocks)
    finally:
        await client.close()


def chunk_blocks(chunk_index: int, base: int = 0) -> list[int]:
    """Block ids of chunk ``chunk_index`` when chunks use consecutive blocks from ``base``."""
    start = base + chunk_index * BLOCKS_PER_CHUNK
    return list(range(start, start + BLOCKS_PER_CHUNK))


def blocks_of(chunks: range, base: int = 0) -> list[int]:
    """Block ids of every chunk in ``chunks`` (consecutive blocks from ``base``)."""
    return [b for c in chunks for b in chunk_blocks(c, base)]


def new_hashes(n: int) -> list[bytes]:
    """``n`` random 32-byte chunk hashes (every test has keys of its own)."""
    return [os.urandom(32) for _ in range(n)]


def row(
    hashes: Sequence[bytes], *, kv_rank: int = 0, salt: str = "", model: str = MODEL
) -> common_pb2.ChunkKeys:
    """A ChunkKeys row."""
    return common_pb2.ChunkKeys(
        model_name=model, cache_salt=salt, kv_rank=kv_rank, chunk_hashes=list(hashes)
    )


def grid(
    hashes: Sequence[bytes], kv_ranks: Sequence[int] = (0,), *, salt: str = "", model: str = MODEL
) -> common_pb2.KeyGrid:
    """A KeyGrid over ``kv_ranks``."""
    return common_pb2.KeyGrid(
        model_name=model, cache_salt=salt, kv_ranks=list(kv_ranks), chunk_hashes=list(hashes)
    )


def object_keys(
    hashes: Sequence[bytes], *, kv_rank: int = 0, salt: str = "", model: str = MODEL
) -> list[common_pb2.ObjectKey]:
    """Full ObjectKeys (DeleteKeys takes those)."""
    return [
        common_pb2.ObjectKey(chunk_hash=h, model_name=model, kv_rank=kv_rank, cache_salt=salt)
        for h in hashes
    ]


class Node:
    """A running storage server and a typed client talking to it over a real socket."""

    def __init__(self, thread: ServerThread, server: Server) -> None:
        self.thread = thread
        self.server = server

        async def connect() -> StorageClient:
            return StorageClient(server.target)

        self.client = thread.run(connect())

    @property
    def app(self) -> StorageApp:
        """The app behind the server (for waits on background work only)."""
        app = self.server.app
        if isinstance(app, NodeApp):  # a kvmesh node: storage and gateway in one process
            return app.storage
        assert isinstance(app, StorageApp)
        return app

    def call(self, method: str, request: Any, **kwargs: Any) -> Any:
        """Call ``StorageClient.<method>(request)`` on the server's loop; its response."""
        return self.thread.run(getattr(self.client, method)(request, **kwargs))

    def error(self, method: str, request: Any) -> grpc.RpcError:
        """The gRPC error ``method`` fails with (the test fails if the call succeeds)."""
        with pytest.raises(grpc.RpcError) as info:
            self.call(method, request)
        return info.value

    def close(self) -> None:
        """Close the client's channel (the server is stopped by the thread)."""
        self.thread.run(self.client.close())

    # -- shorthands of the data path ------------------------------------------------

    def register(self, engine: Engine) -> storage_pb2.RegisterEngineMemoryResponse:
        return self.call("register_engine_memory", engine.register_request())  # type: ignore[no-any-return]

    def store(
        self,
        engine: Engine,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        *,
        kv_rank: int = 0,
        salt: str = "",
    ) -> list[int]:
        """StoreChunks; the outcomes."""
        response = self.call(
            "store_chunks",
            storage_pb2.StoreChunksRequest(
                engine_id=engine.engine_id,
                keys=row(hashes, kv_rank=kv_rank, salt=salt),
                block_ids=list(block_ids),
                chunk_tokens=CHUNK_TOKENS,
            ),
        )
        return list(response.outcomes)

    def retrieve(
        self,
        engine: Engine,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        *,
        skip: int = 0,
        lease: str = "",
        salt: str = "",
        layers: tuple[int, int] | None = None,
    ) -> int:
        """RetrieveChunks (using the lookup locks of ``lease``; only ``layers`` when
        given); chunks copied."""
        request = storage_pb2.RetrieveChunksRequest(
            engine_id=engine.engine_id,
            keys=row(hashes, salt=salt),
            block_ids=list(block_ids),
            chunk_tokens=CHUNK_TOKENS,
            skip_first_n_tokens=skip,
            lease_id=lease,
        )
        if layers is not None:
            request.layers.start, request.layers.end = layers
        response = self.call("retrieve_chunks", request)
        return int(response.retrieved_chunks)

    def lookup(
        self,
        hashes: Sequence[bytes],
        kv_ranks: Sequence[int] = (0,),
        *,
        wait_ms: int = 5000,
        salt: str = "",
    ) -> storage_pb2.LookupAndLockResponse:
        """LookupAndLock that waits for completion by default."""
        return self.call(  # type: ignore[no-any-return]
            "lookup_and_lock",
            storage_pb2.LookupAndLockRequest(
                keys=grid(hashes, kv_ranks, salt=salt), wait_timeout_ms=wait_ms, request_id="test"
            ),
        )

    def delete(
        self,
        hashes: Sequence[bytes],
        tier: int = common_pb2.TIER_L1,
        *,
        force: bool = False,
        backend: str = "",
    ) -> tuple[int, int]:
        """DeleteKeys; (deleted, skipped)."""
        response = self.call(
            "delete_keys",
            storage_pb2.DeleteKeysRequest(
                keys=object_keys(hashes), tier=tier, force=force, backend=backend
            ),
        )
        return int(response.deleted), int(response.skipped)

    def listing(self, tier: int = common_pb2.TIER_ALL, **kwargs: Any) -> list[Any]:
        """Every ListObjects entry, following page tokens."""
        out: list[Any] = []
        token = ""
        while True:
            page = self.call(
                "list_objects",
                storage_pb2.ListObjectsRequest(tier=tier, page_token=token, **kwargs),
            )
            out.extend(page.objects)
            token = page.next_page_token
            if not token:
                return out

    def l1_hashes(self) -> set[bytes]:
        """Chunk hashes resident in L1 (ListObjects)."""
        return {o.key.chunk_hash for o in self.listing(common_pb2.TIER_L1)}

    def l2_hashes(self) -> set[bytes]:
        """Chunk hashes held by the L2 adapters (ListObjects)."""
        return {o.key.chunk_hash for o in self.listing(common_pb2.TIER_L2)}

    def status(self) -> storage_pb2.GetStatusResponse:
        return self.call("get_status", storage_pb2.GetStatusRequest())  # type: ignore[no-any-return]

    def l1_bytes(self, hashes: Sequence[bytes], *, salt: str = "") -> list[bytes]:
        """The L1 bytes of the resident prefix of ``hashes``, read through PrepareRetrieve.

        This reads the node's own shared-memory slots (as an engine-driven
        client would) and commits the transaction, so it leaves no lock behind
        and never touches engine memory.
        """
        prepared = self.call(
            "prepare_retrieve",
            storage_pb2.PrepareRetrieveRequest(
                keys=row(hashes, salt=salt), chunk_bytes=CHUNK_BYTES
            ),
        )
        try:
            return [read_slot(slot) for slot in prepared.slots]
        finally:
            if prepared.transaction_id:
                self.call(
                    "commit_retrieve",
                    storage_pb2.CommitRetrieveRequest(transaction_id=prepared.transaction_id),
                )

    def read_locked_objects(self) -> int:
        return int(self.status().l1.read_locked_objects)

    def wait_written_through(self, hashes: Sequence[bytes], timeout: float = 10.0) -> None:
        """Wait until L2 holds ``hashes`` and the write-through let go of its L1 read locks.

        The adapter lists a key before the write-through's batch gives its read locks
        back, and an L1 delete skips a locked object; a test that deletes from L1
        after a write-through waits for both (it must hold no locks of its own).
        """
        wanted = set(hashes)
        wait_until(lambda: wanted <= self.l2_hashes() and self.read_locked_objects() == 0, timeout)


def _map_region(region: common_pb2.SharedMemoryHandle, *, write: bool) -> tuple[mmap.mmap, int]:
    """Map the page range holding ``region``; returns the mapping and the region's offset in it."""
    start = region.offset_bytes - region.offset_bytes % mmap.ALLOCATIONGRANULARITY
    length = region.offset_bytes + region.size_bytes - start
    fd = os.open(region.path, os.O_RDWR if write else os.O_RDONLY)
    try:
        access = mmap.ACCESS_WRITE if write else mmap.ACCESS_READ
        return mmap.mmap(fd, length, access=access, offset=start), region.offset_bytes - start
    finally:
        os.close(fd)


def read_slot(slot: storage_pb2.Slot) -> bytes:
    """The bytes of an engine-driven slot, read by mapping the node's segment file."""
    mapping, at = _map_region(slot.region, write=False)
    with mapping:
        return mapping[at : at + slot.region.size_bytes]


def write_slot(slot: storage_pb2.Slot, data: bytes) -> None:
    """Write an engine-driven slot through a mapping of the node's segment file."""
    assert len(data) == slot.region.size_bytes
    mapping, at = _map_region(slot.region, write=True)
    with mapping:
        mapping[at : at + len(data)] = data


def assert_intact(
    node: Node,
    engine: Engine,
    engine_before: np.ndarray[Any, Any],
    stored: dict[bytes, bytes],
) -> None:
    """Nothing was lost or corrupted: engine bytes, L1 keys and L1 bytes as before."""
    assert np.array_equal(np.asarray(engine.kv), engine_before), "engine memory changed"
    assert node.l1_hashes() == set(stored), "L1 contents changed"
    hashes = list(stored)
    assert node.l1_bytes(hashes) == [stored[h] for h in hashes], "L1 bytes changed"
    assert node.read_locked_objects() == 0, "a lock was left behind"
