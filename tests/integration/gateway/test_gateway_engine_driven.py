"""The engine-driven path through a real gateway: the test is the engine.

It registers an engine context, maps every slot the gateway returns (path +
offset in the node's shared-memory L1 pool) and writes or reads the chunk
bytes itself, as an engine whose memory storage cannot open would. Chunks
stored this way are the same L1 objects as those of the LMCache-driven path,
so with agreeing layouts each path reads what the other stored.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.gateway.core import transfers
from tests.integration.gateway.support import (
    BLOCK_SIZE,
    CHUNK,
    CHUNK_BYTES,
    HEAD_DIM,
    KV_HEADS,
    MODEL,
    NUM_LAYERS,
    Engine,
    Stack,
    blocks,
    code_of,
    hashes_of,
    object_keys,
    prange,
    prompt,
    read_region,
    write_region,
)

CONTEXT = "ctx-0"


def context_request(**overrides: object) -> gateway_pb2.RegisterEngineContextRequest:
    """RegisterEngineContext with the geometry of the test engines (worker 0 of 1)."""
    layout = gateway_pb2.EngineContextLayout(
        num_layers=NUM_LAYERS,
        block_size=BLOCK_SIZE,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=common_pb2.DTYPE_FLOAT16,
    )
    fields: dict[str, object] = {
        "engine_id": CONTEXT,
        "model_name": MODEL,
        "world_size": 1,
        "worker_id": 0,
        "layout": layout,
    }
    fields.update(overrides)
    return gateway_pb2.RegisterEngineContextRequest(**fields)  # type: ignore[arg-type]


@pytest.fixture
def ctx(stack: Stack) -> Stack:
    """``stack`` with the engine-driven context ``ctx-0`` registered."""
    stack.client.register_engine_context(context_request())
    return stack


def payloads(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(CHUNK_BYTES) for _ in range(n)]


def engine_store(stack: Stack, request_id: str, tokens: list[int], chunks: list[bytes]) -> int:
    """PrepareStore, write each slot through a mapping, CommitStore; chunks committed."""
    prepared = stack.client.prepare_store(
        gateway_pb2.PrepareStoreRequest(
            engine_id=CONTEXT, range=prange(request_id, tokens, 0, len(chunks) * CHUNK)
        )
    )
    for slot in prepared.slots:
        write_region(slot.region, chunks[slot.chunk_index])
    if not prepared.transaction_id:
        return 0
    committed = stack.client.commit_store(
        gateway_pb2.CommitStoreRequest(engine_id=CONTEXT, transaction_id=prepared.transaction_id)
    )
    return int(committed.committed_chunks)


def test_register_engine_context_returns_the_chunk_shape_and_is_idempotent(stack: Stack) -> None:
    first = stack.client.register_engine_context(context_request())
    assert list(first.chunk_shape) == [2, NUM_LAYERS, CHUNK, KV_HEADS * HEAD_DIM]
    assert first.chunk_size == CHUNK
    assert first.dtype == common_pb2.DTYPE_FLOAT16
    assert not first.already_registered
    assert stack.client.register_engine_context(context_request()).already_registered
    assert stack.client.ping(gateway_pb2.PingRequest(engine_id=CONTEXT)).engine_known


def test_mla_context_has_one_plane(stack: Stack) -> None:
    layout = gateway_pb2.EngineContextLayout(
        num_layers=3, block_size=16, kv_heads=1, head_dim=32, dtype=common_pb2.DTYPE_BFLOAT16,
        use_mla=True,
    )  # fmt: skip
    response = stack.client.register_engine_context(context_request(layout=layout))
    assert list(response.chunk_shape) == [1, 3, CHUNK, 32]


def test_re_register_engine_context_with_another_geometry_is_already_exists(ctx: Stack) -> None:
    layout = gateway_pb2.EngineContextLayout(
        num_layers=NUM_LAYERS, block_size=BLOCK_SIZE, kv_heads=KV_HEADS, head_dim=2 * HEAD_DIM,
        dtype=common_pb2.DTYPE_FLOAT16,
    )  # fmt: skip
    error = ctx.error("register_engine_context", context_request(layout=layout))
    assert code_of(error) == "ALREADY_EXISTS"


@pytest.mark.parametrize(
    "layout",
    [
        gateway_pb2.EngineContextLayout(num_layers=2, block_size=16, kv_heads=2, head_dim=8),
        gateway_pb2.EngineContextLayout(
            num_layers=0, block_size=16, kv_heads=2, head_dim=8, dtype=common_pb2.DTYPE_FLOAT16
        ),
        gateway_pb2.EngineContextLayout(
            num_layers=2, block_size=16, kv_heads=2, head_dim=8, dtype=common_pb2.DTYPE_FLOAT16,
            use_mla=True,
        ),
    ],
    ids=["unspecified_dtype", "no_layers", "mla_with_two_heads"],
)  # fmt: skip
def test_a_bad_engine_context_is_invalid(
    stack: Stack, layout: gateway_pb2.EngineContextLayout
) -> None:
    error = stack.error("register_engine_context", context_request(layout=layout))
    assert code_of(error) == "INVALID_ARGUMENT"
    assert not stack.client.ping(gateway_pb2.PingRequest(engine_id=CONTEXT)).engine_known


def test_unregister_engine_context_is_idempotent_and_ends_its_data_path(ctx: Stack) -> None:
    request = gateway_pb2.UnregisterEngineContextRequest(engine_id=CONTEXT)
    assert ctx.client.unregister_engine_context(request).existed
    assert not ctx.client.unregister_engine_context(request).existed
    error = ctx.error(
        "prepare_store",
        gateway_pb2.PrepareStoreRequest(engine_id=CONTEXT, range=prange("r", prompt(1), 0, CHUNK)),
    )
    assert code_of(error) == "FAILED_PRECONDITION"


@pytest.mark.transports  # link: prepare/commit
def test_prepare_store_write_commit_then_prepare_retrieve_reads_the_same_bytes(
    ctx: Stack,
) -> None:
    tokens = prompt(3)
    hashes = hashes_of(tokens)
    data = payloads(3)
    prepared = ctx.client.prepare_store(
        gateway_pb2.PrepareStoreRequest(engine_id=CONTEXT, range=prange("w", tokens, 0, 3 * CHUNK))
    )
    assert prepared.transaction_id
    assert [s.chunk_index for s in prepared.slots] == [0, 1, 2]
    assert all(s.region.size_bytes == CHUNK_BYTES for s in prepared.slots)
    for slot in prepared.slots:
        write_region(slot.region, data[slot.chunk_index])
    assert ctx.l1() == set()  # nothing is readable before the commit
    commit = gateway_pb2.CommitStoreRequest(
        engine_id=CONTEXT, transaction_id=prepared.transaction_id
    )
    assert ctx.client.commit_store(commit).committed_chunks == 3
    assert ctx.l1() == set(hashes)
    assert ctx.l1_bytes(hashes) == data

    # A second prepare of the same range: every chunk is cached, no transaction.
    again = ctx.client.prepare_store(
        gateway_pb2.PrepareStoreRequest(engine_id=CONTEXT, range=prange("w", tokens, 0, 3 * CHUNK))
    )
    assert (again.transaction_id, list(again.slots), again.already_cached_chunks) == ("", [], 3)

    # Retrieve with the lookup's locks: read the slots, commit, every lock released.
    assert ctx.lookup("r", tokens).status.hit_chunks == 3
    read = ctx.client.prepare_retrieve(
        gateway_pb2.PrepareRetrieveRequest(engine_id=CONTEXT, range=prange("r", [], 0, 3 * CHUNK))
    )
    assert [s.chunk_index for s in read.slots] == [0, 1, 2]
    assert [read_region(s.region) for s in read.slots] == data
    assert ctx.locked() == 3
    assert ctx.delete(object_keys(hashes)) == (0, 3)  # locked while the engine copies
    done = ctx.client.commit_retrieve(
        gateway_pb2.CommitRetrieveRequest(engine_id=CONTEXT, transaction_id=read.transaction_id)
    )
    assert done.released_chunks == 3
    assert ctx.locked() == 0  # the transaction's locks and the lookup's
    assert ctx.end_session("r").released_locks == 0
    # Committing the retrieve again is harmless.
    repeat = ctx.client.commit_retrieve(
        gateway_pb2.CommitRetrieveRequest(engine_id=CONTEXT, transaction_id=read.transaction_id)
    )
    assert repeat.released_chunks == 0
    assert ctx.locked() == 0


def test_prepare_store_gives_slots_only_to_chunks_not_cached_yet(ctx: Stack) -> None:
    tokens = prompt(3)
    data = payloads(3)
    assert engine_store(ctx, "w1", tokens, data[:1]) == 1
    prepared = ctx.client.prepare_store(
        gateway_pb2.PrepareStoreRequest(engine_id=CONTEXT, range=prange("w2", tokens, 0, 3 * CHUNK))
    )
    assert [s.chunk_index for s in prepared.slots] == [1, 2]
    assert prepared.already_cached_chunks == 1
    for slot in prepared.slots:
        write_region(slot.region, data[slot.chunk_index])
    ctx.client.commit_store(
        gateway_pb2.CommitStoreRequest(engine_id=CONTEXT, transaction_id=prepared.transaction_id)
    )
    assert ctx.l1_bytes(hashes_of(tokens)) == data


def test_committing_a_store_twice_is_harmless(ctx: Stack) -> None:
    tokens = prompt(1)
    data = payloads(1)
    prepared = ctx.client.prepare_store(
        gateway_pb2.PrepareStoreRequest(engine_id=CONTEXT, range=prange("w", tokens, 0, CHUNK))
    )
    write_region(prepared.slots[0].region, data[0])
    commit = gateway_pb2.CommitStoreRequest(
        engine_id=CONTEXT, transaction_id=prepared.transaction_id
    )
    assert ctx.client.commit_store(commit).committed_chunks == 1
    # A retry after a lost reply: no error, nothing committed twice, the chunk intact.
    assert ctx.client.commit_store(commit).committed_chunks == 0
    assert ctx.l1_bytes(hashes_of(tokens)) == data


def test_prepared_retrieves_never_committed_are_not_remembered_without_bound(
    ctx: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transfers, "_PREPARED_RETRIEVES_KEPT", 2)
    tokens = prompt(1)
    engine_store(ctx, "w", tokens, payloads(1))
    prepared = [
        ctx.client.prepare_retrieve(
            gateway_pb2.PrepareRetrieveRequest(
                engine_id=CONTEXT, range=prange(f"r{i}", tokens, 0, CHUNK)
            )
        ).transaction_id
        for i in range(5)
    ]
    assert list(ctx.app.core.transfers._txn_sessions) == prepared[-2:]
    # The newest still commit as usual.
    for txn in prepared[-2:]:
        request = gateway_pb2.CommitRetrieveRequest(engine_id=CONTEXT, transaction_id=txn)
        assert ctx.client.commit_retrieve(request).released_chunks == 1


def test_prepare_retrieve_without_a_lookup_locks_the_cached_prefix_itself(ctx: Stack) -> None:
    tokens = prompt(3)
    data = payloads(2)
    engine_store(ctx, "w", tokens, data)
    read = ctx.client.prepare_retrieve(
        gateway_pb2.PrepareRetrieveRequest(
            engine_id=CONTEXT, range=prange("r", tokens, 0, 3 * CHUNK)
        )
    )
    assert [s.chunk_index for s in read.slots] == [0, 1]  # the cached prefix of three
    assert [read_region(s.region) for s in read.slots] == data
    assert ctx.locked() == 2
    ctx.client.commit_retrieve(
        gateway_pb2.CommitRetrieveRequest(engine_id=CONTEXT, transaction_id=read.transaction_id)
    )
    assert ctx.locked() == 0
    # Nothing cached: no transaction, no slots.
    none = ctx.client.prepare_retrieve(
        gateway_pb2.PrepareRetrieveRequest(
            engine_id=CONTEXT, range=prange("x", prompt(1), 0, CHUNK)
        )
    )
    assert (none.transaction_id, list(none.slots)) == ("", [])


def test_chunks_stored_by_the_engine_driven_path_are_retrieved_by_the_lmcache_driven_path(
    ctx: Stack, engine: Engine
) -> None:
    ctx.register(engine)
    tokens = prompt(2)
    # The engine-driven writer produces the L1 chunk format of blocks 0..7 of the engine.
    chunks = [engine.chunk(blocks([c])) for c in range(2)]
    assert engine_store(ctx, "w", tokens, chunks) == 2

    assert ctx.lookup("r", tokens).status.hit_chunks == 2
    target = blocks(range(2), base=40)
    engine.fill(target, 0.0)
    got = ctx.retrieve(engine, "r", tokens, 0, 2 * CHUNK, target)
    assert got.retrieved_chunks == 2
    assert engine.blocks_bytes(target) == engine.blocks_bytes(blocks(range(2)))
    assert ctx.locked() == 0


def test_chunks_stored_by_the_lmcache_driven_path_are_read_by_the_engine_driven_path(
    ctx: Stack, engine: Engine
) -> None:
    ctx.register(engine)
    tokens = prompt(2)
    ctx.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2), base=8))
    assert ctx.lookup("r", tokens).status.hit_chunks == 2
    read = ctx.client.prepare_retrieve(
        gateway_pb2.PrepareRetrieveRequest(engine_id=CONTEXT, range=prange("r", [], 0, 2 * CHUNK))
    )
    got = [read_region(s.region) for s in read.slots]
    assert got == [engine.chunk(blocks([c], base=8)) for c in range(2)]
    ctx.client.commit_retrieve(
        gateway_pb2.CommitRetrieveRequest(engine_id=CONTEXT, transaction_id=read.transaction_id)
    )
    assert ctx.locked() == 0
    assert ctx.end_session("r").released_locks == 0
