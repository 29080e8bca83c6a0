"""StorageService semantics over a real socket: every RPC, as the .proto comments promise.

Data-path tests check bytes, not just counts: what lands in L1 is compared
with the chunk format computed from the engine's array, and what a retrieve
writes is compared block by block with the source blocks.
"""

from __future__ import annotations

import time

import numpy as np

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.support import (
    CHUNK_BYTES,
    CHUNK_TOKENS,
    Engine,
    Node,
    chunk_blocks,
    grid,
    new_hashes,
    read_slot,
    row,
    write_slot,
)
from tests.support.waiting import wait_until

STORED = storage_pb2.STORE_OUTCOME_STORED
ALREADY = storage_pb2.STORE_OUTCOME_ALREADY_CACHED


def blocks_of(chunks: range, base: int = 0) -> list[int]:
    return [b for c in chunks for b in chunk_blocks(c, base)]


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


def test_retrieve_release_mask_releases_lookup_locks(node: Node, engine: Engine) -> None:
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    assert node.lookup(hashes).result.hit_chunks == 2
    # Locked by the lookup: a delete without force skips them.
    assert node.delete(hashes) == (0, 2)

    # Release only chunk 0's lookup lock.
    assert node.retrieve(engine, hashes, blocks_of(range(2), 40), release=[True]) == 2
    assert node.delete(hashes) == (1, 1)
    assert node.l1_hashes() == {hashes[1]}

    assert node.retrieve(engine, hashes[1:], blocks_of(range(1), 50), release=[True]) == 1
    assert node.delete(hashes[1:]) == (1, 0)
    assert node.l1_hashes() == set()


# -- lookups and prefetches ---------------------------------------------------------------


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


# -- locks, touch, delete, clear ----------------------------------------------------------


def test_release_locks_counts_released_and_skipped_keys(node: Node, engine: Engine) -> None:
    hashes = new_hashes(3)
    node.store(engine, hashes[:2], blocks_of(range(2)))
    node.call(
        "lookup_and_lock",
        storage_pb2.LookupAndLockRequest(
            keys=grid(hashes[:2]), num_kv_readers=2, wait_timeout_ms=5000
        ),
    )
    request = storage_pb2.ReleaseLocksRequest(keys=grid(hashes))
    first = node.call("release_locks", request)
    assert (first.released_keys, first.skipped_keys) == (2, 1)  # hashes[2] is not in L1
    second = node.call("release_locks", request)
    assert (second.released_keys, second.skipped_keys) == (2, 1)
    third = node.call("release_locks", request)
    assert (third.released_keys, third.skipped_keys) == (0, 3)


def test_release_locks_count_releases_several_locks_per_key(node: Node, engine: Engine) -> None:
    hashes = new_hashes(1)
    node.store(engine, hashes, blocks_of(range(1)))
    node.call(
        "lookup_and_lock",
        storage_pb2.LookupAndLockRequest(keys=grid(hashes), num_kv_readers=3, wait_timeout_ms=5000),
    )
    done = node.call("release_locks", storage_pb2.ReleaseLocksRequest(keys=grid(hashes), count=3))
    assert done.released_keys == 1
    assert node.read_locked_objects() == 0


def test_touch_counts_resident_keys_only(node: Node, engine: Engine) -> None:
    hashes = new_hashes(3)
    node.store(engine, hashes[:2], blocks_of(range(2)))
    touched = node.call("touch_keys", storage_pb2.TouchKeysRequest(keys=grid(hashes)))
    assert touched.touched_keys == 2
    other_rank = node.call("touch_keys", storage_pb2.TouchKeysRequest(keys=grid(hashes, (1,))))
    assert other_rank.touched_keys == 0


def test_touch_protects_keys_from_lru_quota_eviction(node: Node, engine: Engine) -> None:
    hashes = new_hashes(4)
    for i, h in enumerate(hashes):  # one store per chunk: a clear LRU order 0 < 1 < 2 < 3
        node.store(engine, [h], chunk_blocks(i), salt="lru")
    node.call("touch_keys", storage_pb2.TouchKeysRequest(keys=grid(hashes[:1], salt="lru")))
    node.call(
        "set_quota",
        storage_pb2.SetQuotaRequest(
            cache_salt="lru", tier=common_pb2.TIER_L1, limit_bytes=2 * CHUNK_BYTES
        ),
    )
    wait_until(lambda: len(node.l1_hashes()) <= 2)
    assert node.l1_hashes() == {hashes[0], hashes[3]}


def test_delete_without_force_skips_locked_keys_and_with_force_removes_them(
    node: Node, engine: Engine
) -> None:
    hashes = new_hashes(3)
    node.store(engine, hashes, blocks_of(range(3)))
    node.lookup(hashes[:1])
    assert node.delete([*hashes, *new_hashes(1)]) == (2, 2)  # locked + absent are skipped
    assert node.l1_hashes() == {hashes[0]}
    assert node.delete(hashes[:1], force=True) == (1, 0)
    assert node.l1_hashes() == set()
    # Releasing the lock of a force-deleted key is harmless.
    node.call("release_locks", storage_pb2.ReleaseLocksRequest(keys=grid(hashes[:1])))
    assert node.read_locked_objects() == 0


def test_delete_per_tier_and_backend(disk_node: Node, engine: Engine) -> None:
    node = disk_node
    hashes = new_hashes(4)
    node.store(engine, hashes, blocks_of(range(4)))
    wait_until(lambda: node.l2_hashes() == set(hashes))

    assert node.delete(hashes[:1], common_pb2.TIER_L1) == (1, 0)
    assert node.l1_hashes() == set(hashes[1:])
    assert node.l2_hashes() == set(hashes)

    assert node.delete(hashes[1:2], common_pb2.TIER_L2, backend="disk") == (1, 0)
    assert node.l1_hashes() == set(hashes[1:])
    assert node.l2_hashes() == {hashes[0], hashes[2], hashes[3]}

    # TIER_ALL counts per key and tier.
    assert node.delete(hashes[2:], common_pb2.TIER_ALL) == (4, 0)
    assert node.l1_hashes() == {hashes[1]}
    assert node.l2_hashes() == {hashes[0]}


def test_delete_with_a_backend_only_touches_that_adapter(
    make_node: NodeFactory, engine: Engine
) -> None:
    node = make_node(l2=["disk", '{"type": "memory"}'])
    node.register(engine)
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))

    def per_backend() -> dict[str, set[bytes]]:
        out: dict[str, set[bytes]] = {"disk": set(), "memory": set()}
        for o in node.listing(common_pb2.TIER_L2):
            out[o.backend].add(o.key.chunk_hash)
        return out

    wait_until(lambda: per_backend() == {"disk": set(hashes), "memory": set(hashes)})
    assert node.delete(hashes[:1], common_pb2.TIER_L2, backend="memory") == (1, 0)
    assert per_backend() == {"disk": set(hashes), "memory": {hashes[1]}}
    # Without a backend, every adapter: one deleted (disk), one absent (memory) = skipped.
    assert node.delete(hashes[:1], common_pb2.TIER_L2) == (1, 1)
    assert per_backend() == {"disk": {hashes[1]}, "memory": {hashes[1]}}
    assert node.l1_hashes() == set(hashes)


def test_delete_with_an_unknown_backend_is_invalid_and_deletes_nothing(
    disk_node: Node, engine: Engine
) -> None:
    node = disk_node
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    wait_until(lambda: node.l2_hashes() == set(hashes))
    for tier, backend in ((common_pb2.TIER_L2, "redis"), (common_pb2.TIER_L1, "disk")):
        error = node.error(
            "delete_keys",
            storage_pb2.DeleteKeysRequest(
                keys=[common_pb2.ObjectKey(chunk_hash=h, model_name="test/model") for h in hashes],
                tier=tier,
                backend=backend,
            ),
        )
        assert error.code().name == "INVALID_ARGUMENT"
    error = node.error(
        "delete_keys",
        storage_pb2.DeleteKeysRequest(
            keys=[common_pb2.ObjectKey(chunk_hash=hashes[0], model_name="test/model")]
        ),
    )
    assert error.code().name == "INVALID_ARGUMENT"  # TIER_UNSPECIFIED
    assert node.l1_hashes() == set(hashes)
    assert node.l2_hashes() == set(hashes)


def test_clear_drops_unlocked_objects_and_with_force_every_object(
    node: Node, engine: Engine
) -> None:
    hashes = new_hashes(3)
    node.store(engine, hashes, blocks_of(range(3)))
    node.lookup(hashes[:1])
    assert node.call("clear", storage_pb2.ClearRequest()).cleared_objects == 2
    assert node.l1_hashes() == {hashes[0]}
    assert node.call("clear", storage_pb2.ClearRequest(force=True)).cleared_objects == 1
    assert node.l1_hashes() == set()
    assert node.status().l1.resident_objects == 0


# -- status and listings ------------------------------------------------------------------


def test_status_reports_identity_l1_usage_engines_l2_and_salts(
    disk_node: Node, engine: Engine
) -> None:
    node = disk_node
    hashes = new_hashes(3)
    node.store(engine, hashes, blocks_of(range(3)), salt="tenant-a")
    # Delivered: the lock stays, the prefetch is forgotten.
    assert node.lookup(hashes[:1], salt="tenant-a").result.hit_chunks == 1
    wait_until(lambda: node.status().l2[0].object_count == 3)

    status = node.status()
    assert status.instance_id == node.app.instance_id
    assert status.incarnation >= 1
    assert status.l1.configured_bytes == 64 << 20
    assert status.l1.mapped_bytes >= 16 << 20
    assert status.l1.used_bytes >= 3 * CHUNK_BYTES
    assert status.l1.resident_objects == 3
    assert status.l1.staging_objects == 0
    assert status.l1.read_locked_objects == 1
    assert list(status.engine_ids) == [engine.engine_id]
    assert status.active_prefetches == 0
    assert [a.backend for a in status.l2] == ["disk"]
    disk = status.l2[0]
    assert disk.healthy
    assert disk.last_error == ""
    assert disk.used_bytes == 3 * CHUNK_BYTES
    assert disk.pending_stores == 0
    salts = {s.cache_salt: s for s in status.salts}
    assert salts["tenant-a"].used_bytes == 3 * CHUNK_BYTES
    assert salts["tenant-a"].tier == common_pb2.TIER_L1
    assert not salts["tenant-a"].HasField("limit_bytes")


def test_list_objects_pages_across_l1_and_l2(disk_node: Node, engine: Engine) -> None:
    node = disk_node
    hashes = new_hashes(5)
    node.store(engine, hashes, blocks_of(range(5)))
    wait_until(lambda: len(node.l2_hashes()) == 5)
    other = new_hashes(1)
    node.call(
        "store_chunks",
        storage_pb2.StoreChunksRequest(
            engine_id=engine.engine_id,
            keys=row(other, model="other/model"),
            block_ids=chunk_blocks(5),
            chunk_tokens=CHUNK_TOKENS,
        ),
    )
    wait_until(lambda: len(node.l2_hashes()) == 6)

    seen = []
    token = ""
    pages = 0
    while True:
        page = node.call(
            "list_objects",
            storage_pb2.ListObjectsRequest(
                tier=common_pb2.TIER_ALL, model_name="test/model", page_size=3, page_token=token
            ),
        )
        pages += 1
        assert len(page.objects) <= 3
        seen.extend((o.key.chunk_hash, o.tier, o.backend, o.size_bytes) for o in page.objects)
        token = page.next_page_token
        if not token:
            break
    assert pages == 4  # 10 objects in pages of 3
    assert len(seen) == len(set(seen)) == 10
    assert {(h, t) for h, t, _, _ in seen} == {
        (h, t) for h in hashes for t in (common_pb2.TIER_L1, common_pb2.TIER_L2)
    }
    assert {(t, b) for _, t, b, _ in seen} == {
        (common_pb2.TIER_L1, "dram"),
        (common_pb2.TIER_L2, "disk"),
    }
    assert {s for _, _, _, s in seen} == {CHUNK_BYTES}
    # The unfiltered L2 listing of the disk adapter sees the other model's object too.
    assert len(node.listing(common_pb2.TIER_L2, backend="disk")) == 6
    assert node.listing(common_pb2.TIER_L2, backend="redis") == []


def test_list_objects_rejects_bad_paging_and_tier(node: Node) -> None:
    for request in (
        storage_pb2.ListObjectsRequest(tier=common_pb2.TIER_ALL, page_token="not-a-token"),
        storage_pb2.ListObjectsRequest(tier=common_pb2.TIER_ALL, page_token="-3"),
        storage_pb2.ListObjectsRequest(tier=common_pb2.TIER_ALL, page_size=10_001),
        storage_pb2.ListObjectsRequest(tier=common_pb2.TIER_UNSPECIFIED),
    ):
        assert node.error("list_objects", request).code().name == "INVALID_ARGUMENT"


# -- quotas -------------------------------------------------------------------------------


def test_quota_set_get_list_delete(node: Node, engine: Engine) -> None:
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)), salt="tenant-q")
    l1 = common_pb2.TIER_L1
    node.call(
        "set_quota",
        storage_pb2.SetQuotaRequest(cache_salt="tenant-q", tier=l1, limit_bytes=1 << 20),
    )
    node.call(
        "set_quota",
        storage_pb2.SetQuotaRequest(cache_salt="idle", tier=common_pb2.TIER_L2, limit_bytes=5),
    )
    usage = node.call(
        "get_quota", storage_pb2.GetQuotaRequest(cache_salt="tenant-q", tier=l1)
    ).usage
    assert (usage.cache_salt, usage.tier, usage.used_bytes) == ("tenant-q", l1, 2 * CHUNK_BYTES)
    assert usage.HasField("limit_bytes")
    assert usage.limit_bytes == 1 << 20

    listed = node.call("list_quotas", storage_pb2.ListQuotasRequest(tier=l1)).salts
    assert {s.cache_salt for s in listed} == {"tenant-q"}  # "idle" has only an L2 quota
    listed_l2 = node.call(
        "list_quotas", storage_pb2.ListQuotasRequest(tier=common_pb2.TIER_L2)
    ).salts
    assert [(s.cache_salt, s.limit_bytes) for s in listed_l2] == [("idle", 5)]

    request = storage_pb2.DeleteQuotaRequest(cache_salt="tenant-q", tier=l1)
    assert node.call("delete_quota", request).existed
    assert not node.call("delete_quota", request).existed
    after = node.call(
        "get_quota", storage_pb2.GetQuotaRequest(cache_salt="tenant-q", tier=l1)
    ).usage
    assert not after.HasField("limit_bytes")
    assert after.used_bytes == 2 * CHUNK_BYTES
    # The other tier's quota is untouched.
    idle = node.call(
        "get_quota", storage_pb2.GetQuotaRequest(cache_salt="idle", tier=common_pb2.TIER_L2)
    ).usage
    assert idle.limit_bytes == 5


def test_quota_below_usage_evicts_the_salts_own_objects_only(node: Node, engine: Engine) -> None:
    mine = new_hashes(3)
    theirs = new_hashes(2)
    node.store(engine, mine, blocks_of(range(3)), salt="small")
    node.store(engine, theirs, blocks_of(range(3, 5)), salt="big")
    node.call(
        "set_quota",
        storage_pb2.SetQuotaRequest(
            cache_salt="small", tier=common_pb2.TIER_L1, limit_bytes=CHUNK_BYTES
        ),
    )

    def small_usage() -> int:
        return int(
            node.call(
                "get_quota",
                storage_pb2.GetQuotaRequest(cache_salt="small", tier=common_pb2.TIER_L1),
            ).usage.used_bytes
        )

    wait_until(lambda: small_usage() <= CHUNK_BYTES)
    big = node.call(
        "get_quota", storage_pb2.GetQuotaRequest(cache_salt="big", tier=common_pb2.TIER_L1)
    ).usage
    assert big.used_bytes == 2 * CHUNK_BYTES


def test_quota_rpcs_reject_bad_salts_and_tiers(node: Node) -> None:
    bad = [
        ("set_quota", storage_pb2.SetQuotaRequest(cache_salt="a/b", tier=common_pb2.TIER_L1)),
        ("set_quota", storage_pb2.SetQuotaRequest(cache_salt="ok", tier=common_pb2.TIER_ALL)),
        ("get_quota", storage_pb2.GetQuotaRequest(cache_salt="a@b", tier=common_pb2.TIER_L1)),
        ("get_quota", storage_pb2.GetQuotaRequest(cache_salt="ok")),
        ("delete_quota", storage_pb2.DeleteQuotaRequest(cache_salt="x" * 129, tier=1)),
        ("list_quotas", storage_pb2.ListQuotasRequest(tier=common_pb2.TIER_ALL)),
    ]
    for method, request in bad:
        assert node.error(method, request).code().name == "INVALID_ARGUMENT", method
    assert node.call("list_quotas", storage_pb2.ListQuotasRequest(tier=1)).salts == []


# -- engine-driven path -------------------------------------------------------------------


def test_engine_driven_store_then_retrieve_moves_exact_bytes(node: Node) -> None:
    hashes = new_hashes(3)
    payloads = [np.random.default_rng(i).bytes(CHUNK_BYTES) for i in range(3)]
    prepared = node.call(
        "prepare_store", storage_pb2.PrepareStoreRequest(keys=row(hashes), chunk_bytes=CHUNK_BYTES)
    )
    assert prepared.transaction_id
    assert [s.chunk_index for s in prepared.slots] == [0, 1, 2]
    assert (prepared.already_cached_chunks, prepared.skipped_chunks) == (0, 0)
    for slot in prepared.slots:
        assert slot.region.size_bytes == CHUNK_BYTES
        write_slot(slot, payloads[slot.chunk_index])
    # Not readable before the commit.
    assert node.l1_hashes() == set()
    committed = node.call(
        "commit_store", storage_pb2.CommitStoreRequest(transaction_id=prepared.transaction_id)
    )
    assert committed.committed_chunks == 3
    assert node.l1_hashes() == set(hashes)

    again = node.call(
        "prepare_store",
        storage_pb2.PrepareStoreRequest(
            keys=row([*hashes[:1], *new_hashes(1)]), chunk_bytes=CHUNK_BYTES
        ),
    )
    assert again.already_cached_chunks == 1
    assert [s.chunk_index for s in again.slots] == [1]
    node.call("commit_store", storage_pb2.CommitStoreRequest(transaction_id=again.transaction_id))

    read = node.call(
        "prepare_retrieve",
        storage_pb2.PrepareRetrieveRequest(
            keys=row([*hashes, *new_hashes(1)]), chunk_bytes=CHUNK_BYTES
        ),
    )
    assert [s.chunk_index for s in read.slots] == [0, 1, 2]  # the resident prefix
    assert [read_slot(s) for s in read.slots] == payloads
    # Read-locked until the commit.
    assert node.read_locked_objects() == 3
    assert node.delete(hashes) == (0, 3)
    done = node.call(
        "commit_retrieve", storage_pb2.CommitRetrieveRequest(transaction_id=read.transaction_id)
    )
    assert done.released_chunks == 3
    assert node.read_locked_objects() == 0
    # A second commit of the same transaction releases nothing (the .proto: idempotent).
    repeat = node.call(
        "commit_retrieve", storage_pb2.CommitRetrieveRequest(transaction_id=read.transaction_id)
    )
    assert repeat.released_chunks == 0


def test_commit_retrieve_releases_flagged_lookup_locks(node: Node, engine: Engine) -> None:
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    node.lookup(hashes)
    read = node.call(
        "prepare_retrieve",
        storage_pb2.PrepareRetrieveRequest(keys=row(hashes), chunk_bytes=CHUNK_BYTES),
    )
    assert [read_slot(s) for s in read.slots] == [engine.chunk(chunk_blocks(c)) for c in range(2)]
    node.call(
        "commit_retrieve",
        storage_pb2.CommitRetrieveRequest(
            transaction_id=read.transaction_id, release_lookup_locks=[False, True]
        ),
    )
    assert node.delete(hashes) == (1, 1)
    assert node.l1_hashes() == {hashes[0]}


def test_engine_driven_chunks_are_retrievable_into_a_registered_engine(
    node: Node, engine: Engine
) -> None:
    # The two paths share L1: what one stores the other reads.
    hashes = new_hashes(1)
    payload = engine.chunk(chunk_blocks(3))
    prepared = node.call(
        "prepare_store", storage_pb2.PrepareStoreRequest(keys=row(hashes), chunk_bytes=CHUNK_BYTES)
    )
    write_slot(prepared.slots[0], payload)
    node.call(
        "commit_store", storage_pb2.CommitStoreRequest(transaction_id=prepared.transaction_id)
    )
    target = chunk_blocks(0, base=50)
    engine.fill(target, 0.0)
    assert node.retrieve(engine, hashes, target) == 1
    assert engine.blocks_bytes(target) == engine.blocks_bytes(chunk_blocks(3))


def test_prepare_store_when_nothing_fits_is_resource_exhausted(make_node: NodeFactory) -> None:
    node = make_node(l1_size_bytes=8 << 20, l1_segment_bytes=4 << 20)
    size = 4 << 20
    # Staging objects are never evictable: two fill the whole pool.
    first = node.call(
        "prepare_store", storage_pb2.PrepareStoreRequest(keys=row(new_hashes(2)), chunk_bytes=size)
    )
    assert len(first.slots) == 2
    error = node.error(
        "prepare_store", storage_pb2.PrepareStoreRequest(keys=row(new_hashes(1)), chunk_bytes=size)
    )
    assert error.code().name == "RESOURCE_EXHAUSTED"
    # The reservations survived the refusal (a full pool then evicts down to its watermark).
    committed = node.call(
        "commit_store", storage_pb2.CommitStoreRequest(transaction_id=first.transaction_id)
    )
    assert committed.committed_chunks == 2


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
    assert node.retrieve(engine, hashes, target, release=[True] * 4) == 4
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
    wait_until(lambda: node.l2_hashes() == set(hashes[:3]))
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
