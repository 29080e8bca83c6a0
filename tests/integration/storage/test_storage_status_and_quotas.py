"""StorageService over a real socket: status, object listings and per-salt quotas."""

from __future__ import annotations

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from tests.integration.storage.support import (
    CHUNK_BYTES,
    CHUNK_TOKENS,
    Engine,
    Node,
    blocks_of,
    chunk_blocks,
    new_hashes,
    row,
)
from tests.support.waiting import wait_until

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
    # The write-through read-locks its batch until its puts return, a moment after
    # the disk index counts the objects (longer at its lower thread priority): then
    # only the lookup's lock is left.
    wait_until(
        lambda: node.status().l1.read_locked_objects == 1,
        message="the lookup's lock, and only it, stays once the write-through is done",
    )

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
