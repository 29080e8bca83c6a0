"""StorageService over a real socket: lookups and prefetches, as the .proto promises."""

from __future__ import annotations

from kvmesh.api.storage.v1 import storage_pb2
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.support import (
    Engine,
    Node,
    blocks_of,
    chunk_blocks,
    grid,
    new_hashes,
)
from tests.support.waiting import wait_until


def test_lookup_counts_only_the_prefix_present_in_every_rank(node: Node, engine: Engine) -> None:
    hashes = new_hashes(4)
    # Rank 0 has chunks 0-3; rank 1 has 0, 1 and 3 (2 is missing).
    node.store(engine, hashes, blocks_of(range(4)), kv_rank=0)
    node.store(engine, [hashes[0], hashes[1], hashes[3]], blocks_of(range(3)), kv_rank=1)

    response = node.lookup(hashes, kv_ranks=(0, 1))
    assert response.completed
    assert response.result.hit_chunks == 2
    assert response.result.l1_hit_chunks == 2
    assert response.result.l2_hit_chunks == 0

    # Exactly the prefix (2 chunks x 2 ranks) is locked; chunk 3, after the gap, is not.
    released = node.call(
        "release_locks", storage_pb2.ReleaseLocksRequest(keys=grid(hashes, (0, 1)))
    )
    assert (released.released_keys, released.skipped_keys) == (4, 4)
    assert node.read_locked_objects() == 0


def test_lookup_of_a_missing_first_chunk_hits_nothing(node: Node, engine: Engine) -> None:
    hashes = new_hashes(3)
    node.store(engine, hashes[1:], blocks_of(range(2)))
    response = node.lookup(hashes)
    assert response.completed
    assert response.result.hit_chunks == 0
    assert node.read_locked_objects() == 0


def test_l1_only_lookup_answers_at_once_and_is_then_forgotten(node: Node, engine: Engine) -> None:
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    response = node.lookup(hashes, wait_ms=0)
    # L1 alone covers the grid: the result is ready before LookupAndLock returns.
    assert response.completed
    assert response.result.hit_chunks == 2
    error = node.error(
        "get_prefetch_status",
        storage_pb2.GetPrefetchStatusRequest(prefetch_id=response.prefetch_id),
    )
    assert error.code().name == "NOT_FOUND"
    # The delivered locks stay with the caller.
    assert node.read_locked_objects() == 2


def test_get_prefetch_status_delivers_an_l2_prefetch_once_then_not_found(
    make_node: NodeFactory, engine: Engine
) -> None:
    # A slow in-memory L2 keeps the prefetch running past LookupAndLock's answer.
    node = make_node(l2=['{"type": "memory", "latency_s": 0.3}'])
    node.register(engine)
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    wait_until(lambda: node.l2_hashes() == set(hashes))
    node.call("clear", storage_pb2.ClearRequest(force=True))

    response = node.lookup(hashes, wait_ms=0)
    assert not response.completed
    request = storage_pb2.GetPrefetchStatusRequest(prefetch_id=response.prefetch_id)
    assert not node.call("get_prefetch_status", request).completed  # still loading
    waited = node.call(
        "get_prefetch_status",
        storage_pb2.GetPrefetchStatusRequest(
            prefetch_id=response.prefetch_id, wait_timeout_ms=5000
        ),
    )
    assert waited.completed
    assert (waited.result.hit_chunks, waited.result.l2_hit_chunks) == (2, 2)
    assert node.error("get_prefetch_status", request).code().name == "NOT_FOUND"
    assert node.l1_bytes(hashes) == [engine.chunk(chunk_blocks(c)) for c in range(2)]
    assert node.read_locked_objects() == 2


def test_release_prefetch_of_a_delivered_prefetch_keeps_its_locks(
    node: Node, engine: Engine
) -> None:
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    response = node.lookup(hashes)
    assert response.completed
    released = node.call(
        "release_prefetch", storage_pb2.ReleasePrefetchRequest(prefetch_id=response.prefetch_id)
    )
    assert not released.existed
    assert node.read_locked_objects() == 2
    counts = node.call("release_locks", storage_pb2.ReleaseLocksRequest(keys=grid(hashes)))
    assert (counts.released_keys, counts.skipped_keys) == (2, 0)


def test_release_prefetch_of_a_running_prefetch_releases_its_locks_when_it_finishes(
    make_node: NodeFactory, engine: Engine
) -> None:
    # A slow in-memory L2 keeps the prefetch running while it is abandoned.
    node = make_node(l2=['{"type": "memory", "latency_s": 0.3}'])
    node.register(engine)
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    wait_until(lambda: node.l2_hashes() == set(hashes))
    node.call("clear", storage_pb2.ClearRequest(force=True))

    response = node.lookup(hashes, wait_ms=0)
    assert not response.completed  # the L2 adapter answers after 0.3 s
    released = node.call(
        "release_prefetch", storage_pb2.ReleasePrefetchRequest(prefetch_id=response.prefetch_id)
    )
    assert released.existed
    again = node.call(
        "release_prefetch", storage_pb2.ReleasePrefetchRequest(prefetch_id=response.prefetch_id)
    )
    assert not again.existed
    prefetch = node.app.manager.prefetch
    wait_until(lambda: prefetch.stats()["completed"] >= 1 and prefetch.stats()["in_flight"] == 0)
    assert prefetch.stats()["l2_loaded_cells"] == 2  # it did load, then gave the chunks back
    wait_until(lambda: node.read_locked_objects() == 0 and not node.l1_hashes())
    error = node.error(
        "get_prefetch_status",
        storage_pb2.GetPrefetchStatusRequest(prefetch_id=response.prefetch_id),
    )
    assert error.code().name == "NOT_FOUND"
