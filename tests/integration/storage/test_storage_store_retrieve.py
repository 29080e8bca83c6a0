"""StorageService over a real socket: registration, store, retrieve, the L2 round trip.

Every RPC behaves as the .proto comments promise.

Data-path tests check bytes, not just counts: what lands in L1 is compared
with the chunk format computed from the engine's array, and what a retrieve
writes is compared block by block with the source blocks.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.bench.node_figures import parse
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.support import (
    ALREADY,
    CHUNK_BYTES,
    CHUNK_TOKENS,
    LAYER_BYTES,
    NUM_LAYERS,
    STORED,
    Engine,
    Node,
    blocks_of,
    chunk_blocks,
    grid,
    new_hashes,
)
from tests.support.waiting import wait_until

# -- registration -------------------------------------------------------------------------


def test_register_is_idempotent_and_unregister_forgets_the_engine(
    make_node: NodeFactory, engine: Engine
) -> None:
    node = make_node()
    first = node.register(engine)
    assert not first.already_registered
    assert first.instance_id == node.app.instance_id
    assert node.register(engine).already_registered
    assert engine.engine_id in node.status().engine_ids

    gone = node.call(
        "unregister_engine_memory",
        storage_pb2.UnregisterEngineMemoryRequest(engine_id=engine.engine_id),
    )
    assert gone.existed
    again = node.call(
        "unregister_engine_memory",
        storage_pb2.UnregisterEngineMemoryRequest(engine_id=engine.engine_id),
    )
    assert not again.existed
    assert engine.engine_id not in node.status().engine_ids


def test_a_registered_engines_untouched_pages_are_allocated_and_mapped_in_the_background(
    make_node: NodeFactory, engine: Engine
) -> None:
    """The node takes the page faults of an engine's fresh KV file at registration, not in
    the first retrieve (vLLM's pool allocates its file up front; an engine that only
    truncated one gets the same)."""
    sparse = engine.path.parent / f"{engine.engine_id}-sparse-kv"
    with open(sparse, "wb") as f:
        f.truncate(LAYER_BYTES * NUM_LAYERS)
    try:
        node = make_node()
        node.call(
            "register_engine_memory",
            engine.register_request(layers=engine.handles(path=str(sparse))),
        )
        wait_until(lambda: sparse.stat().st_blocks * 512 >= LAYER_BYTES * NUM_LAYERS, 30)
        assert sparse.read_bytes() == bytes(LAYER_BYTES * NUM_LAYERS)
    finally:
        sparse.unlink()


# -- store / retrieve ---------------------------------------------------------------------


def test_store_copies_engine_blocks_into_l1_and_reports_already_cached_on_repeat(
    node: Node, engine: Engine
) -> None:
    hashes = new_hashes(3)
    assert node.store(engine, hashes, blocks_of(range(3))) == [STORED] * 3
    assert node.l1_bytes(hashes) == [engine.chunk(chunk_blocks(c)) for c in range(3)]

    # The first two again plus a new one: only the new one is stored.
    more = [*hashes[:2], *new_hashes(1)]
    assert node.store(engine, more, blocks_of(range(3, 6))) == [ALREADY, ALREADY, STORED]
    # An already-cached chunk keeps its first bytes (blocks 6..9 differ from 0..3).
    assert node.l1_bytes(hashes[:2]) == [engine.chunk(chunk_blocks(c)) for c in range(2)]
    assert node.l1_bytes(more[2:]) == [engine.chunk(chunk_blocks(5))]


def test_retrieve_scatters_exact_bytes_into_the_requested_blocks(
    node: Node, engine: Engine
) -> None:
    hashes = new_hashes(3)
    node.store(engine, hashes, blocks_of(range(3)))
    source = engine.blocks_bytes(blocks_of(range(3)))
    target = blocks_of(range(3), base=40)
    engine.fill(target, 0.0)
    untouched_before = engine.blocks_bytes(range(8, 40))

    assert node.retrieve(engine, hashes, target) == 3
    assert engine.blocks_bytes(target) == source
    assert engine.blocks_bytes(range(8, 40)) == untouched_before
    assert node.read_locked_objects() == 0


def test_retrieve_copies_only_the_resident_prefix(node: Node, engine: Engine) -> None:
    hashes = new_hashes(3)
    node.store(engine, [hashes[0], hashes[2]], blocks_of(range(2)))
    target = blocks_of(range(3), base=40)
    engine.fill(target, 0.0)

    assert node.retrieve(engine, hashes, target) == 1
    assert engine.blocks_bytes(chunk_blocks(0, 40)) == engine.blocks_bytes(chunk_blocks(0))
    assert not np.asarray(engine.kv[:, :, blocks_of(range(1, 3), 40)]).any()


def test_retrieve_skip_first_n_tokens_leaves_the_skipped_blocks_untouched(
    node: Node, engine: Engine
) -> None:
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    target = blocks_of(range(2), base=40)  # blocks 40..43
    for skip, skipped_blocks in ((16, 1), (40, 2)):  # 40 tokens round down to 2 blocks
        engine.fill(target, 7.0)
        sentinel = engine.blocks_bytes(target[:skipped_blocks])
        assert node.retrieve(engine, hashes, target, skip=skip) == 2
        assert engine.blocks_bytes(target[:skipped_blocks]) == sentinel
        assert engine.blocks_bytes(target[skipped_blocks:]) == engine.blocks_bytes(
            blocks_of(range(2))[skipped_blocks:]
        )


def test_a_retrieve_uses_up_its_leases_locks_once(node: Node, engine: Engine) -> None:
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    lookup = node.lookup(hashes)
    assert lookup.result.hit_chunks == 2
    assert lookup.result.lease_ttl_ms > 0
    assert node.status().leases.active == 1
    # Locked by the lookup: a delete without force skips them.
    assert node.delete(hashes) == (0, 2)

    # Chunk 0 retrieved: its lookup lock leaves the lease and is released.
    assert node.retrieve(engine, hashes[:1], blocks_of(range(1), 40), lease=lookup.prefetch_id) == 1
    assert node.retrieve(engine, hashes[:1], blocks_of(range(1), 44), lease=lookup.prefetch_id) == 1
    assert node.delete(hashes) == (1, 1)  # the second retrieve released nothing more
    assert node.l1_hashes() == {hashes[1]}

    assert node.retrieve(engine, hashes[1:], blocks_of(range(1), 50), lease=lookup.prefetch_id) == 1
    assert node.delete(hashes[1:]) == (1, 0)
    assert node.l1_hashes() == set()
    assert node.status().leases.held_locks == 0


def test_a_load_by_layers_writes_each_parts_layers_and_the_last_part_uses_the_lease(
    node: Node, engine: Engine
) -> None:
    assert NUM_LAYERS == 2
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    lookup = node.lookup(hashes)
    target = blocks_of(range(2), base=40)
    engine.fill(target, 0.0)
    touched = _Touches()
    node.app.node.manager.l1.add_listener(touched)

    assert node.retrieve(engine, hashes, target, lease=lookup.prefetch_id, layers=(0, 1)) == 2
    assert np.array_equal(engine.kv[0][:, target], engine.kv[0][:, blocks_of(range(2))])
    assert not np.asarray(engine.kv[1][:, target]).any()  # layer 1: not yet
    # The first part left the lease's locks in place: the chunks cannot go meanwhile.
    assert node.status().leases.held_locks == 2
    assert node.delete(hashes) == (0, 2)

    assert touched.calls == []  # a use is counted once per load, on its last part
    assert node.retrieve(engine, hashes, target, lease=lookup.prefetch_id, layers=(1, 2)) == 2
    assert engine.blocks_bytes(target) == engine.blocks_bytes(blocks_of(range(2)))
    assert node.status().leases.held_locks == 0
    assert node.read_locked_objects() == 0
    assert [{k.chunk_hash for k in keys} for keys in touched.calls] == [set(hashes)]


class _Touches:
    """An L1 listener that records the keys of each LRU touch (each ACCESS event)."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def on_admitted(self, keys: Any, sizes: Any, from_l2: bool) -> None:
        pass

    def on_removed(self, keys: Any, sizes: Any, reason: Any) -> None:
        pass

    def on_touched(self, keys: Any) -> None:
        self.calls.append(list(keys))


def test_ending_a_lease_releases_what_it_holds_and_an_old_id_is_unknown(
    node: Node, engine: Engine
) -> None:
    hashes = new_hashes(3)
    node.store(engine, hashes, blocks_of(range(3)))
    lease = node.lookup(hashes).prefetch_id
    freed = node.call(
        "release_lease",
        storage_pb2.ReleaseLeaseRequest(lease_id=lease, start_chunk=0, end_chunk=1),
    )
    assert (freed.existed, freed.released_locks) == (True, 1)
    assert node.delete(hashes) == (1, 2)
    ended = node.call("release_lease", storage_pb2.ReleaseLeaseRequest(lease_id=lease, end=True))
    assert (ended.existed, ended.released_locks) == (True, 2)
    again = node.call("release_lease", storage_pb2.ReleaseLeaseRequest(lease_id=lease, end=True))
    assert (again.existed, again.released_locks) == (False, 0)
    assert node.status().leases.active == 0
    assert node.status().leases.held_locks == 0


# -- L2 round trip ------------------------------------------------------------------------


def test_l2_round_trip_after_l1_is_cleared(disk_node: Node, engine: Engine) -> None:
    node = disk_node
    hashes = new_hashes(4)
    node.store(engine, hashes, blocks_of(range(4)))
    expected = [engine.chunk(chunk_blocks(c)) for c in range(4)]
    deadline = time.monotonic() + 10
    while node.status().l2[0].object_count < 4 or node.status().l2[0].pending_stores:
        assert time.monotonic() < deadline, "write-through to disk did not finish"
        time.sleep(0.02)
    assert node.l2_hashes() == set(hashes)

    assert node.call("clear", storage_pb2.ClearRequest(force=True)).cleared_objects == 4
    assert node.l1_hashes() == set()

    response = node.lookup(hashes, wait_ms=5000)
    assert response.completed
    assert (response.result.hit_chunks, response.result.l2_hit_chunks) == (4, 4)
    assert response.result.l1_hit_chunks == 0
    assert node.l1_bytes(hashes) == expected

    target = blocks_of(range(4), base=40)
    engine.fill(target, 0.0)
    assert node.retrieve(engine, hashes, target, lease=response.prefetch_id) == 4
    assert engine.blocks_bytes(target) == engine.blocks_bytes(blocks_of(range(4)))
    # Loaded chunks are temporary (default prefetch policy): gone with their last reader.
    assert node.read_locked_objects() == 0
    assert node.l1_hashes() == set()
    assert node.l2_hashes() == set(hashes)


def test_lookup_mixes_l1_and_l2_hits_and_stops_at_the_first_miss(
    disk_node: Node, engine: Engine
) -> None:
    node = disk_node
    hashes = new_hashes(4)
    node.store(engine, hashes[:3], blocks_of(range(3)))
    node.wait_written_through(hashes[:3])
    node.delete(hashes[1:3], common_pb2.TIER_L1)  # chunk 0 in L1, chunks 1-2 only on disk
    node.store(engine, hashes[3:], chunk_blocks(3))  # chunk 3: L1 only

    # A miss at chunk 1: chunk 2 (on disk) is after it and is never loaded.
    response = node.lookup([hashes[0], new_hashes(1)[0], hashes[2]])
    assert (response.result.hit_chunks, response.result.l2_hit_chunks) == (1, 0)
    assert node.l1_hashes() == {hashes[0], hashes[3]}
    node.call("release_locks", storage_pb2.ReleaseLocksRequest(keys=grid(hashes[:1])))

    response = node.lookup(hashes)
    assert (response.result.hit_chunks, response.result.l1_hit_chunks) == (4, 2)
    assert response.result.l2_hit_chunks == 2
    assert node.l1_bytes(hashes) == [engine.chunk(chunk_blocks(c)) for c in range(4)]


def test_a_miss_on_the_nodes_own_disk_is_answered_by_its_index(
    disk_node: Node, engine: Engine
) -> None:
    """The disk directory is the node's alone: a chunk its index lacks is absent, and the
    lookup ends there without a prefetch worker (kvmesh_storage_lookups_by_index_total)."""
    node = disk_node
    registry = CollectorRegistry()
    for collector in node.app.collectors():
        registry.register(collector)

    def by_index() -> float:
        samples = parse(generate_latest(registry).decode())
        return sum(
            v for (n, _), v in samples.items() if n == "kvmesh_storage_lookups_by_index_total"
        )

    hashes = new_hashes(2)
    node.store(engine, hashes[:1], blocks_of(range(1)))
    node.wait_written_through(hashes[:1])
    node.delete(hashes[:1], common_pb2.TIER_L1)  # on disk only
    response = node.lookup(hashes[1:], wait_ms=0)  # absent everywhere
    assert response.completed  # answered within the call, without waiting
    assert response.result.hit_chunks == 0
    assert by_index() == 1
    response = node.lookup(hashes, wait_ms=5000)  # chunk 0 on disk: loaded, then chunk 1 misses
    assert (response.result.hit_chunks, response.result.l2_hit_chunks) == (1, 1)
    assert by_index() == 1


def test_a_copy_whose_caller_is_about_to_give_up_never_starts(node: Node, engine: Engine) -> None:
    """A deadline under the copy-start margin: DEADLINE_EXCEEDED, no engine memory touched."""
    import grpc

    from kvmesh.common.deadlines import COPY_START_MARGIN_S
    from tests.integration.storage.support import CHUNK_TOKENS as TOKENS
    from tests.integration.storage.support import row

    node.register(engine)
    hashes = new_hashes(2)
    request = storage_pb2.StoreChunksRequest(
        engine_id=engine.engine_id, keys=row(hashes), block_ids=blocks_of(range(2)),
        chunk_tokens=TOKENS,
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        node.call("store_chunks", request, timeout=COPY_START_MARGIN_S / 2)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # Nothing was stored (the reservation was given back), and a caller that waits may copy.
    assert node.store(engine, hashes, blocks_of(range(2))) == [STORED] * 2
    target = blocks_of(range(2), base=40)
    engine.fill(target, 0.0)
    before = engine.blocks_bytes(target)
    retrieve = storage_pb2.RetrieveChunksRequest(
        engine_id=engine.engine_id, keys=row(hashes), block_ids=target, chunk_tokens=TOKENS
    )
    with pytest.raises(grpc.RpcError) as info:
        node.call("retrieve_chunks", retrieve, timeout=COPY_START_MARGIN_S / 2)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(COPY_START_MARGIN_S)  # a copy started late would have landed by now
    assert engine.blocks_bytes(target) == before


def test_the_node_counts_its_copies_bytes_and_time_by_direction(node: Node, engine: Engine) -> None:
    """kvmesh_storage_copies/copy_bytes/copy_seconds: a store's objects, a retrieve's bytes
    less the tokens it skipped, a part of a load by layers its share of the layers."""
    registry = CollectorRegistry()
    for collector in node.app.collectors():
        registry.register(collector)

    def copies() -> dict[str, tuple[float, float, float]]:
        samples = parse(generate_latest(registry).decode())
        out = {}
        for direction in ("store", "retrieve"):
            label = (("direction", direction),)
            out[direction] = tuple(
                sum(v for (n, ls), v in samples.items() if n == name and label[0] in ls)
                for name in (
                    "kvmesh_storage_copies_total",
                    "kvmesh_storage_copy_bytes_total",
                    "kvmesh_storage_copy_seconds_total",
                )
            )
        return out  # type: ignore[return-value]

    assert copies() == {"store": (0, 0, 0), "retrieve": (0, 0, 0)}
    hashes = new_hashes(3)
    assert node.store(engine, hashes, blocks_of(range(3))) == [STORED] * 3
    assert node.store(engine, hashes, blocks_of(range(3))) == [ALREADY] * 3  # nothing to copy
    count, nbytes, seconds = copies()["store"]
    assert (count, nbytes) == (1, 3 * CHUNK_BYTES)
    assert seconds > 0

    target = blocks_of(range(3), base=40)
    assert node.retrieve(engine, hashes, target) == 3
    assert node.retrieve(engine, hashes, target, skip=16) == 3
    assert node.retrieve(engine, hashes, target, layers=(0, 1)) == 3
    count, nbytes, seconds = copies()["retrieve"]
    token_bytes = CHUNK_BYTES // CHUNK_TOKENS
    whole = 3 * CHUNK_TOKENS * token_bytes
    assert count == 3
    assert nbytes == whole + (whole - 16 * token_bytes) + whole // NUM_LAYERS
    assert seconds > 0
    assert copies()["store"][0] == 1  # retrieves count apart
