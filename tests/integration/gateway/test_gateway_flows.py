"""Whole request flows through a real gateway and storage node.

- lookup → prefetch from a disk L2 → retrieve, with a partial hit (a prefix
  in L1, the next chunks only on disk, then a chunk missing from both tiers);
- prefetches that outlive the Lookup call (a slow L2): WaitPrefetchStatus
  timeouts, and a wait that does not hold up other RPCs;
- two engine workers of one tensor-parallel model sharing a node;
- clients that go away: a session left idle (its locks expire with the
  gateway's session TTL), a Lookup cancelled while it waits, and the normal
  EndSession.

The flows that hinge on the transport (waits, cancellation, a prefetch that
outlives its call) are marked ``transports`` and run under every arrangement.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.gateway.client import GatewayClient
from tests.integration.gateway.conftest import StackFactory
from tests.integration.gateway.support import (
    CHUNK,
    MODEL,
    Engine,
    Stack,
    blocks,
    hashes_of,
    object_keys,
    prange,
    prompt,
)
from tests.support.waiting import wait_until

SLOW_L2 = '{"type": "memory", "latency_s": 0.5}'


def wait_write_through(stack: Stack, count: int) -> None:
    """Until the node's first L2 adapter holds ``count`` objects and has nothing pending."""

    def done() -> bool:
        l2 = stack.node.status().l2[0]
        return l2.object_count >= count and l2.pending_stores == 0

    wait_until(done, timeout=10.0)


def in_l2_only(stack: Stack, engine: Engine, tokens: list[int], n_chunks: int) -> None:
    """Store ``n_chunks`` chunks, wait until they are on L2, then empty L1."""
    stack.store(engine, "writer", tokens, 0, n_chunks * CHUNK, blocks(range(n_chunks)))
    wait_write_through(stack, n_chunks)
    stack.client.clear(gateway_pb2.ClearRequest(force=True))
    assert stack.l1() == set()


# -- L2 ------------------------------------------------------------------------------------


def test_lookup_prefetch_retrieve_with_a_partial_l2_hit(
    make_stack: StackFactory, engine: Engine
) -> None:
    stack = make_stack(storage={"l2": ["disk"]})
    stack.register(engine)
    tokens = prompt(5)
    hashes = hashes_of(tokens)
    in_l2_only(stack, engine, tokens, 4)
    # Chunk 0 back in L1; chunks 1-2 only on disk; chunk 3 gone from both tiers;
    # chunk 4 in L1 but after the miss, so it is never part of the prefix.
    stack.store(engine, "writer", tokens, 0, CHUNK, blocks([0]))
    deleted = stack.node.call(
        "delete_keys",
        storage_pb2.DeleteKeysRequest(
            keys=object_keys(hashes[3:4]), tier=common_pb2.TIER_ALL, force=True
        ),
    )
    assert deleted.deleted == 1
    stack.store(engine, "writer", tokens, 4 * CHUNK, 5 * CHUNK, blocks([4]))
    # Write-through reads L1 objects under a read lock: let it finish before counting locks.
    wait_until(lambda: stack.node.l2_hashes() == {*hashes[:3], hashes[4]})
    wait_write_through(stack, 4)
    wait_until(lambda: stack.locked() == 0)

    looked = stack.lookup("req", tokens, wait_ms=5000)
    status = looked.status
    assert status.completed
    assert (status.hit_chunks, status.hit_tokens) == (3, 3 * CHUNK)
    assert (status.l1_hit_chunks, status.l2_hit_chunks) == (1, 2)
    assert stack.locked() == 3

    target = blocks(range(5), base=40)[:16]  # blocks 40..55: chunks 0-3 of the range
    engine.fill(target, 0.0)
    got = stack.retrieve(engine, "req", [], 0, 4 * CHUNK, target)
    assert (got.retrieved_chunks, got.retrieved_tokens) == (3, 3 * CHUNK)
    assert engine.blocks_bytes(target[:12]) == engine.blocks_bytes(blocks(range(3)))
    assert (engine.kv[:, :, target[12:]] == 0).all()  # the missing chunk was not written

    assert stack.end_session("req").released_locks == 0
    assert stack.locked() == 0
    # Loaded chunks were temporary (default prefetch policy): L1 is as before the lookup.
    wait_until(lambda: stack.l1() == {hashes[0], hashes[4]})
    assert stack.node.l2_hashes() == {*hashes[:3], hashes[4]}


@pytest.mark.transports  # parked waits that time out
def test_wait_prefetch_status_times_out_while_l2_loads_then_completes(
    make_stack: StackFactory, engine: Engine
) -> None:
    stack = make_stack(storage={"l2": [SLOW_L2]})
    stack.register(engine)
    tokens = prompt(2)
    in_l2_only(stack, engine, tokens, 2)

    looked = stack.lookup("r", tokens, wait_ms=0)
    assert not looked.status.completed
    assert looked.requested_chunks == 2
    query = stack.client.query_prefetch_status(
        gateway_pb2.QueryPrefetchStatusRequest(request_id="r")
    )
    assert not query.status.completed
    short = stack.client.wait_prefetch_status(
        gateway_pb2.WaitPrefetchStatusRequest(request_id="r", timeout_ms=1)
    )
    assert not short.status.completed
    done = stack.client.wait_prefetch_status(
        gateway_pb2.WaitPrefetchStatusRequest(request_id="r", timeout_ms=10_000)
    )
    assert done.status.completed
    assert (done.status.hit_chunks, done.status.l2_hit_chunks) == (2, 2)
    assert stack.locked() == 2
    # Completed results are kept: a query after the wait sees the same.
    again = stack.client.query_prefetch_status(
        gateway_pb2.QueryPrefetchStatusRequest(request_id="r")
    )
    assert again.status == done.status
    assert stack.end_session("r").released_locks == 2
    wait_until(lambda: stack.locked() == 0 and stack.l1() == set())


@pytest.mark.transports  # a parked wait
def test_a_parked_wait_does_not_hold_up_other_rpcs(
    make_stack: StackFactory, engine: Engine
) -> None:
    stack = make_stack(storage={"l2": ['{"type": "memory", "latency_s": 1.5}']})
    stack.register(engine)
    tokens = prompt(1)
    in_l2_only(stack, engine, tokens, 1)
    stack.lookup("slow", tokens, wait_ms=0)

    finished = threading.Event()
    results: list[gateway_pb2.WaitPrefetchStatusResponse] = []

    def wait() -> None:
        with GatewayClient(stack.gateway.target) as other:
            results.append(
                other.wait_prefetch_status(
                    gateway_pb2.WaitPrefetchStatusRequest(request_id="slow", timeout_ms=10_000)
                )
            )
        finished.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        # The wait is parked once it holds the request's session (a peek at the core).
        session = stack.app.core.sessions.get("slow")
        assert session is not None
        wait_until(session.lock.locked)
        # While the wait is parked: other RPCs (and other requests' lookups) are answered,
        # and a query of the same request answers with what is known, without waiting.
        query = gateway_pb2.QueryPrefetchStatusRequest(request_id="slow")
        assert not stack.client.query_prefetch_status(query).status.completed
        assert stack.client.get_chunk_size(gateway_pb2.GetChunkSizeRequest()).chunk_size == CHUNK
        other = prompt(1)
        stack.store(engine, "w2", other, 0, CHUNK, blocks([5]))
        assert stack.lookup("fast", other).status.hit_chunks == 1
        assert not finished.is_set()
    finally:
        waiter.join(timeout=15)
    assert results
    assert results[0].status.completed
    assert results[0].status.hit_chunks == 1


# -- two workers of one model ---------------------------------------------------------------


def test_two_tp_workers_share_a_node_and_the_scheduler_sees_chunks_both_ranks_hold(
    stack: Stack, make_engine: Callable[..., Engine]
) -> None:
    worker0, worker1 = make_engine(seed=1), make_engine(seed=2)
    stack.register(worker0, world_size=2, worker=0)
    stack.register(worker1, world_size=2, worker=1)
    tokens = prompt(4)
    # Each worker stores its own rank; worker 1 only has the first two chunks.
    stored0 = stack.store(worker0, "req", tokens, 0, 4 * CHUNK, blocks(range(4)), world_size=2)
    stored1 = stack.store(worker1, "req", tokens, 0, 2 * CHUNK, blocks(range(2)), world_size=2)
    assert (stored0.stored_chunks, stored1.stored_chunks) == (4, 2)
    # The same hashes, two kv ranks: six distinct objects.
    assert len(stack.node.listing(common_pb2.TIER_L1)) == 6

    # A world-size-1 lookup of the same tokens sees nothing: other keys.
    assert stack.lookup("solo", tokens).status.hit_chunks == 0
    looked = stack.lookup("req", tokens, world_size=2)
    assert looked.status.hit_chunks == 2
    assert stack.locked() == 4  # two chunks x two ranks

    target = blocks(range(2), base=40)
    for worker in (worker0, worker1):
        worker.fill(target, 0.0)
        got = stack.retrieve(worker, "req", [], 0, 2 * CHUNK, target, world_size=2)
        assert got.retrieved_chunks == 2
        assert worker.blocks_bytes(target) == worker.blocks_bytes(blocks(range(2)))
    # The two engines' data differ, so each got its own rank.
    assert worker0.blocks_bytes(target) != worker1.blocks_bytes(target)
    assert stack.locked() == 0
    assert stack.end_session("req").released_locks == 0


def test_a_tp_lookup_locks_only_the_prefix_every_rank_holds(
    stack: Stack, make_engine: Callable[..., Engine]
) -> None:
    worker0, worker1 = make_engine(seed=1), make_engine(seed=2)
    stack.register(worker0, world_size=2, worker=0)
    stack.register(worker1, world_size=2, worker=1)
    tokens = prompt(3)
    hashes = hashes_of(tokens)
    stack.store(worker0, "req", tokens, 0, 3 * CHUNK, blocks(range(3)), world_size=2)
    stack.store(worker1, "req", tokens, 0, CHUNK, blocks([0]), world_size=2)
    assert stack.lookup("req", tokens, world_size=2).status.hit_chunks == 1
    # Rank 0's chunks 1 and 2 are not locked (deletable); chunk 0 of both ranks is.
    rank0 = object_keys(hashes, world_size=2, worker=0)
    rank1 = object_keys(hashes, world_size=2, worker=1)
    assert stack.delete(rank0[1:]) == (2, 0)
    assert stack.delete([rank0[0], rank1[0]]) == (0, 2)
    assert stack.end_session("req").released_locks == 2
    assert stack.delete([rank0[0], rank1[0]]) == (2, 0)


# -- clients that go away -------------------------------------------------------------------


def test_locks_of_a_client_that_vanished_are_released_by_the_session_ttl(
    make_stack: StackFactory, engine: Engine
) -> None:
    stack = make_stack(gateway={"session_ttl_seconds": 0.5})
    stack.register(engine)
    tokens = prompt(2)
    keys = object_keys(hashes_of(tokens))
    stack.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)))

    with GatewayClient(stack.gateway.target) as scheduler:
        looked = scheduler.lookup(
            gateway_pb2.LookupRequest(
                request_id="gone", model_name=MODEL, world_size=1, token_ids=tokens,
                wait_timeout_ms=1000,
            )
        )  # fmt: skip
        assert looked.status.hit_chunks == 2
    # The channel is closed without EndSession: the locks are still held ...
    assert stack.locked() == 2
    assert stack.delete(keys) == (0, 2)
    # ... until the session expires.
    wait_until(lambda: stack.locked() == 0, timeout=10.0)
    assert stack.app.core.stats()["sessions_expired"] >= 1
    assert stack.delete(keys) == (2, 0)
    request = gateway_pb2.QueryPrefetchStatusRequest(request_id="gone")
    error = stack.error("query_prefetch_status", request)
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_calls_that_name_no_request_keep_no_session(stack: Stack, engine: Engine) -> None:
    stack.register(engine)
    for seed in range(3):
        tokens = prompt(2, seed=seed)
        assert stack.store(engine, "", tokens, 0, 2 * CHUNK, blocks(range(2))).stored_chunks == 2
    assert stack.app.core.stats()["active_sessions"] == 0


def test_a_session_in_use_does_not_expire(make_stack: StackFactory, engine: Engine) -> None:
    stack = make_stack(gateway={"session_ttl_seconds": 0.5})
    stack.register(engine)
    tokens = prompt(1)
    stack.store(engine, "w", tokens, 0, CHUNK, blocks([0]))
    stack.lookup("busy", tokens)
    request = gateway_pb2.QueryPrefetchStatusRequest(request_id="busy")
    # Keep the session busy for three TTLs: its lock stays.
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert stack.client.query_prefetch_status(request).status.hit_chunks == 1
        time.sleep(0.05)
    assert stack.locked() == 1
    assert stack.end_session("busy").released_locks == 1


def test_end_session_releases_the_locks_at_once_in_the_normal_case(
    make_stack: StackFactory, engine: Engine
) -> None:
    # A long TTL: only EndSession can be what releases.
    stack = make_stack(gateway={"session_ttl_seconds": 600})
    stack.register(engine)
    tokens = prompt(2)
    stack.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)))
    stack.lookup("r", tokens)
    assert stack.locked() == 2
    assert stack.end_session("r").released_locks == 2
    assert stack.locked() == 0


@pytest.mark.transports  # cancellation
def test_a_lookup_cancelled_while_it_waits_leaves_no_lock_behind(
    make_stack: StackFactory, engine: Engine
) -> None:
    stack = make_stack(storage={"l2": [SLOW_L2]})
    stack.register(engine)
    tokens = prompt(2)
    in_l2_only(stack, engine, tokens, 2)

    with GatewayClient(stack.gateway.target) as scheduler:
        call = scheduler._stub.Lookup.future(
            gateway_pb2.LookupRequest(
                request_id="cancelled", model_name=MODEL, world_size=1, token_ids=tokens,
                wait_timeout_ms=10_000,
            ),
            timeout=20,
        )  # fmt: skip
        # The prefetch is running on the node: the client goes away mid-call.
        wait_until(lambda: stack.node.status().active_prefetches == 1)
        call.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            call.result()
    # When the L2 load finishes, its locks must not be left to the 300 s read TTL.
    prefetch = stack.node.app.manager.prefetch
    wait_until(lambda: prefetch.stats()["completed"] >= 1 and prefetch.stats()["in_flight"] == 0)
    wait_until(lambda: stack.locked() == 0, timeout=5.0)
    wait_until(lambda: stack.node.status().active_prefetches == 0, timeout=5.0)


@pytest.mark.transports  # a prefetch outliving its call
def test_end_session_during_an_l2_prefetch_gives_its_locks_back_when_it_finishes(
    make_stack: StackFactory, engine: Engine
) -> None:
    stack = make_stack(storage={"l2": [SLOW_L2]})
    stack.register(engine)
    tokens = prompt(2)
    in_l2_only(stack, engine, tokens, 2)
    assert not stack.lookup("r", tokens, wait_ms=0).status.completed
    ended = stack.end_session("r")
    assert (ended.existed, ended.released_locks) == (True, 0)
    # The loads finish after the session is gone: nothing stays locked or loaded.
    prefetch = stack.node.app.manager.prefetch
    wait_until(lambda: prefetch.stats()["completed"] >= 1 and prefetch.stats()["in_flight"] == 0)
    wait_until(lambda: stack.locked() == 0 and stack.l1() == set())


# -- identity -------------------------------------------------------------------------------


def test_a_cache_salt_keeps_one_tenants_chunks_from_another(stack: Stack, engine: Engine) -> None:
    stack.register(engine)
    tokens = prompt(2)
    stack.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)), salt="tenant-a")
    assert stack.lookup("plain", tokens).status.hit_chunks == 0
    assert stack.lookup("other", tokens, salt="tenant-b").status.hit_chunks == 0
    assert stack.lookup("same", tokens, salt="tenant-a").status.hit_chunks == 2

    target = blocks(range(2), base=40)
    engine.fill(target, 0.0)
    stolen = stack.retrieve(engine, "other", tokens, 0, 2 * CHUNK, target, salt="tenant-b")
    assert stolen.retrieved_chunks == 0
    assert (engine.kv[:, :, target] == 0).all()
    got = stack.retrieve(engine, "same", tokens, 0, 2 * CHUNK, target, salt="tenant-a")
    assert got.retrieved_chunks == 2
    assert engine.blocks_bytes(target) == engine.blocks_bytes(blocks(range(2)))
    assert stack.locked() == 0


def test_each_of_several_readers_of_one_rank_releases_its_own_lookup_lock(
    stack: Stack, make_engine: Callable[..., Engine]
) -> None:
    # MLA-style replication: two engines read the same kv rank (num_kv_readers = 2).
    first, second = make_engine(seed=1), make_engine(seed=1)
    stack.register(first)
    stack.register(second)
    tokens = prompt(1)
    keys = object_keys(hashes_of(tokens))
    stack.store(first, "w", tokens, 0, CHUNK, blocks([0]))
    assert stack.lookup("r", tokens, readers=2).status.hit_chunks == 1
    stack.retrieve(first, "r", tokens, 0, CHUNK, blocks([0], base=40))
    assert stack.delete(keys) == (0, 1)  # the second reader's lock is still held
    stack.retrieve(second, "r", tokens, 0, CHUNK, blocks([0], base=40))
    assert second.blocks_bytes(blocks([0], base=40)) == first.blocks_bytes(blocks([0]))
    assert stack.end_session("r").released_locks == 0
    assert stack.delete(keys) == (1, 0)


def test_a_silent_engine_is_unmapped_and_a_beating_one_kept(
    make_stack: StackFactory, make_engine: Callable[..., Engine]
) -> None:
    """Silent for the reap time (pinged or not: a killed engine never says goodbye)."""
    stack = make_stack(gateway={"engine_reap_seconds": 1.0, "session_ttl_seconds": 0.4})
    silent, beating = make_engine(seed=1), make_engine(seed=2)
    stack.register(silent)
    stack.register(beating)

    def beat() -> bool:
        stack.client.ping(gateway_pb2.PingRequest(engine_id=beating.engine_id))
        return silent.engine_id not in stack.node.status().engine_ids

    wait_until(beat, timeout=10.0, interval=0.2)
    assert not stack.client.ping(gateway_pb2.PingRequest(engine_id=silent.engine_id)).engine_known
    assert beating.engine_id in stack.node.status().engine_ids
    stack.register(silent)  # it may come back
    assert silent.engine_id in stack.node.status().engine_ids


def test_a_retrieve_that_fails_mid_way_never_costs_another_request_its_lock(
    stack: Stack, engine: Engine
) -> None:
    """The engine goes away between lookup and retrieve: storage owns the locks (a lease),
    so EndSession afterwards releases this request's locks once and never another's."""
    stack.register(engine)
    tokens = prompt(2)
    keys = object_keys(hashes_of(tokens))
    stack.store(engine, "w", tokens, 0, 2 * CHUNK, blocks(range(2)))
    mine = stack.lookup("mine", tokens)
    assert mine.status.lease.lease_id
    assert mine.status.lease.end_token == 2 * CHUNK
    assert mine.status.lease.ttl_ms > 0
    stack.lookup("other", tokens)
    assert stack.locked() == 2
    stack.client.unregister_kv_cache(
        gateway_pb2.UnregisterKVCacheRequest(engine_id=engine.engine_id)
    )
    request = gateway_pb2.RetrieveRequest(
        engine_id=engine.engine_id, range=prange("mine", tokens, 0, 2 * CHUNK),
        block_ids=blocks(range(2), base=40),
    )  # fmt: skip
    assert stack.error("retrieve", request).code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stack.end_session("mine").released_locks == 2
    assert stack.end_session("mine").released_locks == 0
    assert stack.delete(keys) == (0, 2)  # "other" still holds both
    assert stack.end_session("other").released_locks == 2
    assert stack.delete(keys) == (2, 0)
    status = stack.node.status()
    assert (status.leases.active, status.leases.held_locks) == (0, 0)
