"""StorageService over a real socket: lock release, touch, delete and clear."""

from __future__ import annotations

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.support import (
    CHUNK_BYTES,
    Engine,
    Node,
    blocks_of,
    chunk_blocks,
    grid,
    new_hashes,
)
from tests.support.waiting import wait_until


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
    node.wait_written_through(hashes)

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
