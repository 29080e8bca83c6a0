"""GatewayService over real sockets: every RPC as its .proto comment promises.

Each test runs a real storage node and a real gateway (chunk 64 tokens,
engine block size 16) and talks to the gateway with the typed
``GatewayClient``; what the gateway did is checked behind it on the storage
node (L1 keys and bytes, read locks, refused deletes) and in the engine's
shared-memory KV file, byte for byte.

Tests marked ``transports`` run under every arrangement (see conftest): a
wait against the caller's deadline, and the ones that take each storage
link through its calls.
"""

from __future__ import annotations

import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from tests.integration.gateway.conftest import StackFactory
from tests.integration.gateway.support import (
    BLOCK_SIZE,
    CHUNK,
    NUM_LAYERS,
    Engine,
    Stack,
    blocks,
    code_of,
    hashes_of,
    object_keys,
    prange,
    prompt,
)

# -- registration -------------------------------------------------------------------------


@pytest.mark.transports  # storage's answer relayed
def test_register_reports_chunk_size_and_storage_instance_and_is_idempotent(
    stack: Stack, engine: Engine
) -> None:
    first = stack.register(engine)
    assert not first.already_registered
    assert first.chunk_size == CHUNK
    assert first.storage_instance_id == stack.node.app.instance_id
    assert engine.engine_id in stack.node.status().engine_ids

    again = stack.register(engine)
    assert again.already_registered
    assert again.storage_instance_id == stack.node.app.instance_id
    ping = stack.client.ping(gateway_pb2.PingRequest(engine_id=engine.engine_id))
    assert ping.engine_known


def test_re_register_with_a_different_layout_is_already_exists_and_keeps_the_first(
    ready: Stack, engine: Engine
) -> None:
    error = ready.error(
        "register_kv_cache",
        gateway_pb2.RegisterKVCacheRequest(
            engine_id=engine.engine_id,
            model_name="test/model",
            world_size=1,
            worker_id=0,
            layout=engine.layout(num_blocks=32),
            layers=engine.handles(size_bytes=engine.handles()[0].shared_memory.size_bytes // 2),
        ),
    )
    assert code_of(error) == "ALREADY_EXISTS"
    # The first registration still works end to end.
    tokens = prompt(1)
    assert ready.store(engine, "r", tokens, 0, CHUNK, blocks([0])).stored_chunks == 1


def test_register_after_a_gateway_restart_finds_the_engine_already_mapped(
    make_stack: StackFactory, engine: Engine
) -> None:
    first = make_stack()
    first.register(engine)
    # A new gateway (a restart) in front of the same node: storage still maps the engine.
    second = make_stack(node=first.node)
    response = second.register(engine)
    assert response.already_registered
    tokens = prompt(1)
    assert second.store(engine, "r", tokens, 0, CHUNK, blocks([0])).stored_chunks == 1


@pytest.mark.transports  # link: unregister_engine
def test_unregister_unmaps_the_engine_and_is_idempotent(ready: Stack, engine: Engine) -> None:
    request = gateway_pb2.UnregisterKVCacheRequest(engine_id=engine.engine_id)
    assert ready.client.unregister_kv_cache(request).existed
    assert engine.engine_id not in ready.node.status().engine_ids
    assert not ready.client.unregister_kv_cache(request).existed
    error = ready.error(
        "store",
        gateway_pb2.StoreRequest(
            engine_id=engine.engine_id,
            range=gateway_pb2.PromptRange(
                request_id="r", model_name="test/model", world_size=1,
                token_ids=prompt(1), start_token=0, end_token=CHUNK,
            ),
            block_ids=blocks([0]),
        ),
    )  # fmt: skip
    assert code_of(error) == "FAILED_PRECONDITION"


# -- store / retrieve ---------------------------------------------------------------------


def test_store_copies_engine_blocks_into_l1_and_counts_already_cached(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(3)
    hashes = hashes_of(tokens)
    first = ready.store(engine, "r1", tokens, 0, 2 * CHUNK, blocks(range(2)))
    assert (first.stored_chunks, first.already_cached_chunks, first.skipped_chunks) == (2, 0, 0)
    assert ready.l1() == set(hashes[:2])
    assert ready.l1_bytes(hashes[:2]) == [engine.chunk(blocks([c])) for c in range(2)]

    # The whole prompt from other blocks: two cached (kept as they were), one new.
    again = ready.store(engine, "r2", tokens, 0, 3 * CHUNK, blocks(range(3), base=20))
    assert (again.stored_chunks, again.already_cached_chunks, again.skipped_chunks) == (1, 2, 0)
    expected = [engine.chunk(blocks([0])), engine.chunk(blocks([1])), engine.chunk(blocks([2], 20))]
    assert ready.l1_bytes(hashes) == expected


def test_store_of_a_later_range_uses_the_tokens_the_session_already_has(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(2)
    ready.store(engine, "r", tokens, 0, CHUNK, blocks([0]))
    # The second store sends no tokens: the session keeps them (PromptRange.token_ids).
    second = ready.store(engine, "r", [], CHUNK, 2 * CHUNK, blocks([1]))
    assert second.stored_chunks == 1
    assert ready.l1() == set(hashes_of(tokens))
    assert ready.l1_bytes(hashes_of(tokens)) == [engine.chunk(blocks([c])) for c in range(2)]


@pytest.mark.transports  # link: the data path
def test_retrieve_writes_exact_bytes_into_the_engines_blocks_and_uses_the_lookup_locks(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(3, extra=10)
    ready.store(engine, "w", tokens, 0, 3 * CHUNK, blocks(range(3)))
    looked = ready.lookup("r", tokens)
    assert looked.status.hit_chunks == 3
    assert ready.locked() == 3

    target = blocks(range(3), base=32)
    engine.fill(target, 0.0)
    before = engine.snapshot()
    response = ready.retrieve(engine, "r", [], 0, 3 * CHUNK, target)
    assert (response.retrieved_chunks, response.retrieved_tokens) == (3, 3 * CHUNK)
    assert engine.blocks_bytes(target) == engine.blocks_bytes(blocks(range(3)))
    # Nothing else in the engine changed.
    after = engine.snapshot()
    after[:, :, target] = before[:, :, target]
    assert (after == before).all()
    # One lookup lock per retrieved chunk was released: nothing left to end.
    assert ready.locked() == 0
    assert ready.end_session("r").released_locks == 0


@pytest.mark.transports  # the lane and gRPC both carry the layer range
def test_a_retrieve_by_layers_writes_each_parts_layers_and_counts_the_load_once(
    ready: Stack, engine: Engine
) -> None:
    assert NUM_LAYERS == 2
    tokens = prompt(2)
    ready.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)))
    ready.lookup("r", tokens)
    target = blocks(range(2), base=40)
    engine.fill(target, 0.0)
    counters = ready.app.core.counters
    retrieves, chunks = counters.retrieves, counters.retrieved_chunks

    first = ready.retrieve(engine, "r", tokens, 0, 2 * CHUNK, target, layers=(0, 1))
    assert first.retrieved_chunks == 2
    assert (engine.kv[0][:, target] == engine.kv[0][:, blocks(range(2))]).all()
    assert (engine.kv[1][:, target] == 0).all()
    assert ready.locked() == 2  # the lookup's locks wait for the last part
    # A later part may leave the tokens out: the session has them.
    last = ready.retrieve(engine, "r", [], 0, 2 * CHUNK, target, layers=(1, 2))
    assert last.retrieved_chunks == 2
    assert engine.blocks_bytes(target) == engine.blocks_bytes(blocks(range(2)))
    assert ready.locked() == 0
    assert (counters.retrieves, counters.retrieved_chunks) == (retrieves + 1, chunks + 2)

    for bad in ((0, 0), (1, 3), (2, 1)):
        error = ready.error(
            "retrieve",
            gateway_pb2.RetrieveRequest(
                engine_id=engine.engine_id,
                range=prange("r", tokens, 0, 2 * CHUNK),
                block_ids=target,
                layers=common_pb2.LayerRange(start=bad[0], end=bad[1]),
            ),
        )
        assert code_of(error) == "INVALID_ARGUMENT"
        assert "2 layers" in (error.details() or "")


@pytest.mark.transports  # the lane and gRPC both carry RetrieveAhead
def test_a_load_started_ahead_is_joined_by_the_workers_retrieve_and_copied_once(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(3)
    ready.store(engine, "w", tokens, 0, 3 * CHUNK, blocks(range(3)))
    ready.lookup("r", tokens)
    target = blocks(range(3), base=40)
    engine.fill(target, 0.0)
    counters = ready.app.core.counters
    retrieves = counters.retrieves
    request = gateway_pb2.RetrieveRequest(
        engine_id=engine.engine_id,
        range=prange("r", tokens, 0, 3 * CHUNK),
        block_ids=target,
    )

    assert ready.client.retrieve_ahead(request).started is True
    assert ready.client.retrieve_ahead(request).started is False  # already running
    assert ready.client.retrieve(request).retrieved_chunks == 3
    assert engine.blocks_bytes(target) == engine.blocks_bytes(blocks(range(3)))
    assert ready.locked() == 0
    assert (counters.retrieves - retrieves, counters.retrieves_joined) == (1, 1)
    # After the worker asked, an ahead call starts nothing (it would write blocks
    # the engine may already use).
    engine.fill(target, 0.0)
    assert ready.client.retrieve_ahead(request).started is False
    assert (engine.kv[0][:, target] == 0).all()
    assert counters.retrieves - retrieves == 1

    bad = gateway_pb2.RetrieveRequest()
    bad.CopyFrom(request)
    bad.layers.start, bad.layers.end = 0, 1
    assert code_of(ready.error("retrieve_ahead", bad)) == "INVALID_ARGUMENT"
    bad = gateway_pb2.RetrieveRequest()
    bad.CopyFrom(request)
    bad.engine_id = "nobody"
    assert code_of(ready.error("retrieve_ahead", bad)) == "FAILED_PRECONDITION"
    bad = gateway_pb2.RetrieveRequest()
    bad.CopyFrom(request)
    del bad.block_ids[1:]
    assert code_of(ready.error("retrieve_ahead", bad)) == "INVALID_ARGUMENT"


def test_retrieve_skip_first_n_tokens_leaves_the_skipped_blocks_untouched(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(2)
    ready.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)))
    ready.lookup("r", tokens)
    target = blocks(range(2), base=40)
    engine.fill(target, 0.0)
    # 20 tokens: rounded down to one whole block of 16.
    response = ready.retrieve(engine, "r", tokens, 0, 2 * CHUNK, target, skip=BLOCK_SIZE + 4)
    assert response.retrieved_chunks == 2
    assert (engine.kv[:, :, target[:1]] == 0).all()
    assert engine.blocks_bytes(target[1:]) == engine.blocks_bytes(blocks(range(2))[1:])
    assert ready.end_session("r").released_locks == 0
    assert ready.locked() == 0


def test_retrieve_copies_the_cached_prefix_and_reports_how_far_it_got(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(3)
    ready.store(engine, "w", tokens, 0, CHUNK, blocks([0]))
    target = blocks(range(3), base=40)
    engine.fill(target, 0.0)
    response = ready.retrieve(engine, "r", tokens, 0, 3 * CHUNK, target)
    assert (response.retrieved_chunks, response.retrieved_tokens) == (1, CHUNK)
    assert engine.blocks_bytes(target[:4]) == engine.blocks_bytes(blocks([0]))
    assert (engine.kv[:, :, target[4:]] == 0).all()


# -- lookup family ------------------------------------------------------------------------


def test_lookup_with_wait_returns_the_completed_hit_prefix_and_locks_it(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(4, extra=30)
    ready.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)))
    response = ready.lookup("r", tokens, wait_ms=2000)
    assert response.requested_chunks == 4
    status = response.status
    assert status.completed
    assert (status.hit_chunks, status.hit_tokens) == (2, 2 * CHUNK)
    assert (status.l1_hit_chunks, status.l2_hit_chunks) == (2, 0)
    assert ready.locked() == 2
    assert ready.delete(object_keys(hashes_of(tokens, 2))) == (0, 2)


def test_lookup_without_wait_of_l1_hits_is_complete_at_once(ready: Stack, engine: Engine) -> None:
    tokens = prompt(2)
    ready.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)))
    response = ready.lookup("r", tokens, wait_ms=0)
    assert response.status.completed
    assert response.status.hit_chunks == 2


def test_lookup_end_token_limits_the_chunks_looked_up(ready: Stack, engine: Engine) -> None:
    tokens = prompt(3)
    ready.store(engine, "w", tokens, 0, 3 * CHUNK, blocks(range(3)))
    response = ready.lookup("r", tokens, end=2 * CHUNK + 5)
    assert response.requested_chunks == 2
    assert response.status.hit_chunks == 2
    assert ready.locked() == 2


def test_lookup_num_kv_readers_takes_that_many_locks_and_end_session_releases_them(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(2)
    ready.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)))
    ready.lookup("r", tokens, readers=3)
    assert ready.end_session("r").released_locks == 6
    assert ready.locked() == 0


def test_lookup_without_a_registered_engine_is_an_immediate_miss(stack: Stack) -> None:
    response = stack.lookup("r", prompt(2), wait_ms=0)
    assert response.status.completed
    assert response.status.hit_chunks == 0
    assert response.requested_chunks == 2


def test_a_second_lookup_of_the_same_request_replaces_the_first_and_its_locks(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(3)
    ready.store(engine, "w", tokens, 0, 3 * CHUNK, blocks(range(3)))
    assert ready.lookup("r", tokens).status.hit_chunks == 3
    assert ready.locked() == 3
    # Same request, shorter range: the first lookup's three locks are released.
    second = ready.lookup("r", tokens, end=CHUNK)
    assert second.status.hit_chunks == 1
    assert ready.locked() == 1
    query = ready.client.query_prefetch_status(
        gateway_pb2.QueryPrefetchStatusRequest(request_id="r")
    )
    assert query.status.hit_chunks == 1
    assert ready.end_session("r").released_locks == 1
    assert ready.locked() == 0


def test_query_prefetch_status_is_repeatable_until_the_session_ends(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(2)
    ready.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)))
    ready.lookup("r", tokens, wait_ms=0)
    request = gateway_pb2.QueryPrefetchStatusRequest(request_id="r")
    first = ready.client.query_prefetch_status(request)
    second = ready.client.query_prefetch_status(request)
    assert first == second
    assert first.status.completed
    assert first.status.hit_chunks == 2
    ready.end_session("r")
    assert code_of(ready.error("query_prefetch_status", request)) == "NOT_FOUND"


@pytest.mark.transports  # a wait longer than the deadline
def test_wait_prefetch_status_of_a_completed_lookup_answers_at_once(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(1)
    ready.store(engine, "w", tokens, 0, CHUNK, blocks([0]))
    ready.lookup("r", tokens, wait_ms=0)
    waited = ready.client.wait_prefetch_status(
        gateway_pb2.WaitPrefetchStatusRequest(request_id="r", timeout_ms=60_000), timeout=5.0
    )
    assert waited.status.completed
    assert waited.status.hit_chunks == 1


def test_free_lookup_locks_releases_the_range_once(ready: Stack, engine: Engine) -> None:
    tokens = prompt(4)
    hashes = hashes_of(tokens)
    ready.store(engine, "w", tokens, 0, 4 * CHUNK, blocks(range(4)))
    ready.lookup("r", tokens)
    request = gateway_pb2.FreeLookupLocksRequest(request_id="r", start_token=0, end_token=2 * CHUNK)
    assert ready.client.free_lookup_locks(request).released_locks == 2
    assert ready.client.free_lookup_locks(request).released_locks == 0
    assert ready.locked() == 2
    # The freed chunks can be deleted, the others cannot.
    assert ready.delete(object_keys(hashes[:2])) == (2, 0)
    assert ready.delete(object_keys(hashes[2:])) == (0, 2)
    # An empty range releases nothing.
    empty = gateway_pb2.FreeLookupLocksRequest(request_id="r", start_token=CHUNK, end_token=CHUNK)
    assert ready.client.free_lookup_locks(empty).released_locks == 0
    assert ready.end_session("r").released_locks == 2


def test_end_session_releases_what_remains_so_a_plain_delete_then_succeeds(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(3)
    keys = object_keys(hashes_of(tokens))
    ready.store(engine, "w", tokens, 0, 3 * CHUNK, blocks(range(3)))
    ready.lookup("r", tokens)
    # The retrieve of chunk 0 uses its lock; chunks 1 and 2 stay locked.
    ready.retrieve(engine, "r", tokens, 0, CHUNK, blocks([0], base=40))
    assert ready.delete(keys) == (1, 2)  # chunk 0 was unlocked and is gone now

    ended = ready.end_session("r")
    assert (ended.existed, ended.released_locks) == (True, 2)
    assert ready.locked() == 0
    assert ready.delete(keys[1:]) == (2, 0)
    again = ready.end_session("r")
    assert (again.existed, again.released_locks) == (False, 0)


def test_end_session_of_an_unknown_request_succeeds_with_existed_false(stack: Stack) -> None:
    response = stack.end_session("never-seen")
    assert (response.existed, response.released_locks) == (False, 0)


# -- clear, chunk size, ping, block allocations -------------------------------------------


@pytest.mark.transports  # link: clear
def test_clear_drops_unlocked_objects_and_with_force_locked_ones_too(
    ready: Stack, engine: Engine
) -> None:
    tokens = prompt(3)
    hashes = hashes_of(tokens)
    ready.store(engine, "w", tokens, 0, 3 * CHUNK, blocks(range(3)))
    ready.lookup("r", tokens, end=CHUNK)  # chunk 0 locked
    assert ready.client.clear(gateway_pb2.ClearRequest()).cleared_objects == 2
    assert ready.l1() == {hashes[0]}
    assert ready.client.clear(gateway_pb2.ClearRequest(force=True)).cleared_objects == 1
    assert ready.l1() == set()
    # The session's lock is gone with the object; ending it is still harmless.
    assert ready.end_session("r").existed
    assert ready.locked() == 0


def test_get_chunk_size_is_the_configured_chunk(stack: Stack) -> None:
    response = stack.client.get_chunk_size(gateway_pb2.GetChunkSizeRequest())
    assert response.chunk_size == CHUNK


def test_ping_reports_whether_the_engine_is_known(ready: Stack, engine: Engine) -> None:
    assert ready.client.ping(gateway_pb2.PingRequest()).engine_known
    assert ready.client.ping(gateway_pb2.PingRequest(engine_id=engine.engine_id)).engine_known
    assert not ready.client.ping(gateway_pb2.PingRequest(engine_id="nobody")).engine_known


def test_report_block_allocation_is_counted(ready: Stack, engine: Engine) -> None:
    ready.client.report_block_allocation(
        gateway_pb2.ReportBlockAllocationRequest(
            engine_id=engine.engine_id,
            model_name="test/model",
            allocations=[
                gateway_pb2.BlockAllocation(
                    request_id="a", new_block_ids=[1, 2], new_token_ids=[7]
                ),
                gateway_pb2.BlockAllocation(request_id="b", new_block_ids=[3]),
            ],
        )
    )
    assert ready.app.core.stats()["block_allocations"] == 2
