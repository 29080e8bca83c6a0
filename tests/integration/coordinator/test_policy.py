"""PolicyService over a real socket: quotas, pins, usage, eviction and deletes down node streams.

Eviction and operator deletes leave as ``DeleteKeysCommand`` on the holding
node's own event stream (a :class:`RawNode` plays the node here); the LRU and
usage change only when the node's DELETE events come back.
"""

from __future__ import annotations

import grpc
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import directory_pb2, policy_pb2
from tests.integration.coordinator.conftest import CHUNK, CoordFactory
from tests.integration.coordinator.support import (
    ACCESS,
    ADMITTED,
    CONFIG,
    DELETE,
    L1,
    L2,
    MODEL,
    Coord,
    RawNode,
    batch,
    code_of,
    entry,
    field_of,
    hkey,
    pkey,
    stores,
    token_hashes,
)
from tests.support.waiting import wait_until

ALL = common_pb2.TIER_ALL


def _error(call: object, *args: object) -> grpc.RpcError:
    assert callable(call)
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    return info.value


# ------------------------------------------------------------------------------ quotas


def test_quotas_set_get_list_delete(coord: Coord) -> None:
    p = coord.clients.policy
    coord.clients.ingest_batches(batch("node-a", 1, tier=L2, entries=stores([1, 2], salt="t")))
    quota = p.set_quota(policy_pb2.SetQuotaRequest(cache_salt="t", tier=L2, limit_bytes=1000))
    assert (quota.quota.cache_salt, quota.quota.limit_bytes, quota.quota.used_bytes) == (
        "t",
        1000,
        200,
    )
    # Unspecified tier means L2; a zero limit is a real quota.
    p.set_quota(policy_pb2.SetQuotaRequest(cache_salt="zero", limit_bytes=0))
    got = p.get_quota(policy_pb2.GetQuotaRequest(cache_salt="zero", tier=L2)).quota
    assert got.HasField("limit_bytes")
    assert got.limit_bytes == 0
    none = p.get_quota(policy_pb2.GetQuotaRequest(cache_salt="other", tier=L2)).quota
    assert (none.HasField("limit_bytes"), none.used_bytes) == (False, 0)
    listing = p.list_quotas(policy_pb2.ListQuotasRequest(tier=L2))
    assert [(q.cache_salt, q.limit_bytes, q.used_bytes) for q in listing.quotas] == [
        ("t", 1000, 200),
        ("zero", 0, 0),
    ]
    assert listing.total_used_bytes == 200
    assert p.delete_quota(policy_pb2.DeleteQuotaRequest(cache_salt="t", tier=L2)).existed
    assert not p.delete_quota(policy_pb2.DeleteQuotaRequest(cache_salt="t", tier=L2)).existed
    after = p.list_quotas(policy_pb2.ListQuotasRequest(tier=L2)).quotas
    # A salt with usage stays listed without a limit.
    assert [(q.cache_salt, q.HasField("limit_bytes")) for q in after] == [
        ("t", False),
        ("zero", True),
    ]


def test_l1_quota_reads_show_usage_only(coord: Coord) -> None:
    p = coord.clients.policy
    coord.clients.ingest_batches(batch("node-a", 1, tier=L1, entries=stores([1], salt="t")))
    got = p.get_quota(policy_pb2.GetQuotaRequest(cache_salt="t", tier=L1)).quota
    assert (got.tier, got.used_bytes, got.HasField("limit_bytes")) == (L1, 100, False)
    listing = p.list_quotas(policy_pb2.ListQuotasRequest(tier=L1))
    assert [(q.cache_salt, q.used_bytes) for q in listing.quotas] == [("t", 100)]


@pytest.mark.parametrize(
    ("method", "request_", "field"),
    [
        ("set_quota", policy_pb2.SetQuotaRequest(cache_salt="t", tier=L1), "tier"),
        ("set_quota", policy_pb2.SetQuotaRequest(cache_salt="a@b", tier=L2), "cache_salt"),
        ("get_quota", policy_pb2.GetQuotaRequest(cache_salt="t", tier=ALL), "tier"),
        ("delete_quota", policy_pb2.DeleteQuotaRequest(cache_salt="t", tier=L1), "tier"),
        ("set_default_quota", policy_pb2.SetDefaultQuotaRequest(tier=L1), "tier"),
        ("list_pins", policy_pb2.ListPinsRequest(page_size=10_001), "page_size"),
        ("list_pins", policy_pb2.ListPinsRequest(page_token="x"), "page_token"),
        ("pin_keys", policy_pb2.PinKeysRequest(), "query"),
    ],
)
def test_bad_policy_requests_are_invalid_argument(
    coord: Coord, method: str, request_: object, field: str
) -> None:
    error = _error(getattr(coord.clients.policy, method), request_)
    assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(error) == field


def test_default_quota_is_unset_at_boot_and_settable(coord: Coord) -> None:
    """Unset at boot; 0 is a real limit; a value round-trips; clearable."""
    p = coord.clients.policy
    assert not p.get_default_quota(policy_pb2.GetDefaultQuotaRequest()).HasField("limit_bytes")
    p.set_default_quota(policy_pb2.SetDefaultQuotaRequest(tier=L2, limit_bytes=0))
    got = p.get_default_quota(policy_pb2.GetDefaultQuotaRequest(tier=L2))
    assert got.HasField("limit_bytes")
    assert got.limit_bytes == 0
    p.set_default_quota(policy_pb2.SetDefaultQuotaRequest(tier=L2, limit_bytes=2048))
    assert p.get_default_quota(policy_pb2.GetDefaultQuotaRequest()).limit_bytes == 2048
    cleared = p.set_default_quota(policy_pb2.SetDefaultQuotaRequest(tier=L2))
    assert not cleared.HasField("limit_bytes")
    assert not p.get_default_quota(policy_pb2.GetDefaultQuotaRequest()).HasField("limit_bytes")


# -------------------------------------------------------------------------------- pins


def test_pins_by_keys_and_tokens_are_counted_and_paged(coord: Coord) -> None:
    p = coord.clients.policy
    keys = [pkey(i) for i in range(1, 6)]
    pinned = p.pin_keys(policy_pb2.PinKeysRequest(keys=directory_pb2.KeyList(keys=keys)))
    assert (pinned.requested_chunks, pinned.affected_keys) == (5, 5)
    p.pin_keys(policy_pb2.PinKeysRequest(keys=directory_pb2.KeyList(keys=[pkey(1)])))
    # Another object group of a chunk is the same pin.
    p.pin_keys(policy_pb2.PinKeysRequest(keys=directory_pb2.KeyList(keys=[pkey(2, group=3)])))
    tokens = list(range(9))  # 2 chunks of 4
    by_tokens = p.pin_keys(
        policy_pb2.PinKeysRequest(
            tokens=directory_pb2.TokenQuery(model_name=MODEL, cache_salt="t", token_ids=tokens)
        )
    )
    assert (by_tokens.requested_chunks, by_tokens.affected_keys) == (2, 2)
    seen: list[tuple[bytes, str, int]] = []
    token = ""
    pages = 0
    while True:
        page = p.list_pins(policy_pb2.ListPinsRequest(page_size=2, page_token=token))
        pages += 1
        assert page.total == 7
        seen.extend((x.key.chunk_hash, x.key.cache_salt, x.pin_count) for x in page.pins)
        token = page.next_page_token
        if not token:
            break
    assert pages == 4
    h0, h1 = token_hashes(tokens, CHUNK)
    assert seen == [
        (pkey(1).chunk_hash, "", 2),
        (pkey(2).chunk_hash, "", 2),
        (pkey(3).chunk_hash, "", 1),
        (pkey(4).chunk_hash, "", 1),
        (pkey(5).chunk_hash, "", 1),
        (h0, "t", 1),
        (h1, "t", 1),
    ]
    salted = p.list_pins(policy_pb2.ListPinsRequest(cache_salt="t"))
    assert (salted.total, [x.key.chunk_hash for x in salted.pins]) == (2, [h0, h1])
    assert p.list_pins(policy_pb2.ListPinsRequest(model_name="other")).total == 0
    unpinned = p.unpin_keys(
        policy_pb2.UnpinKeysRequest(keys=directory_pb2.KeyList(keys=[pkey(1), pkey(99)]))
    )
    assert unpinned.requested_chunks == 2
    p.unpin_keys(
        policy_pb2.UnpinKeysRequest(
            tokens=directory_pb2.TokenQuery(model_name=MODEL, cache_salt="t", token_ids=tokens)
        )
    )
    left = {x.key.chunk_hash: x.pin_count for x in p.list_pins(policy_pb2.ListPinsRequest()).pins}
    assert left == {pkey(i).chunk_hash: c for i, c in ((1, 1), (2, 2), (3, 1), (4, 1), (5, 1))}


# ------------------------------------------------------------------------------- usage


def test_usage_per_instance_compartment_and_shared_pool(coord: Coord) -> None:
    c = coord.clients
    c.register("node-a")
    c.ingest_batches(
        batch("node-a", 1, tier=L1, event_type=CONFIG, capacity_bytes=1000, capacity_revision=1),
        batch("node-a", 2, tier=L1, entries=stores([1, 2], size=125, salt="t")),
        batch("node-a", 3, tier=L2, entries=stores([1], size=300)),
        batch("node-a", 4, tier=L2, backend="s3", shared=True, entries=stores([5], size=40)),
        batch("node-b", 1, tier=L2, backend="s3", shared=True, entries=stores([5], size=40)),
    )
    usage = c.usage()
    instances = {i.instance_id: i for i in usage.instances}
    a = instances["node-a"]
    assert (a.registered, a.declared_capacity) == (True, True)
    modules = {(m.tier, m.backend): m for m in a.modules}
    dram = modules[(L1, "dram")]
    assert (dram.used_bytes, dram.capacity_bytes, dram.usage_ratio) == (250, 1000, 0.25)
    disk = modules[(L2, "disk")]
    assert (disk.used_bytes, disk.capacity_bytes, disk.HasField("usage_ratio")) == (300, 0, False)
    # The shared pool appears once, fleet-wide, never under an instance.
    assert [(m.backend, m.shared, m.used_bytes) for m in usage.shared_modules] == [("s3", True, 40)]
    assert "node-b" not in instances or not instances["node-b"].modules
    salts = {(s.tier, s.cache_salt): s.used_bytes for s in usage.salts}
    assert salts == {(L1, "t"): 250, (L2, ""): 340}


def test_usage_follows_stores_and_deletes_and_ignores_access(coord: Coord) -> None:
    """Stores count, ACCESS and an empty store are admitted without changing usage.

    A DELETE subtracts the size that was stored (its own entry says 0), and a
    DELETE of a key never stored changes nothing.
    """
    c = coord.clients

    def used() -> int:
        return c.policy.get_quota(
            policy_pb2.GetQuotaRequest(cache_salt="t", tier=L2)
        ).quota.used_bytes

    stored = c.ingest_batches(batch("node-a", 1, tier=L2, entries=stores([1, 2], 300, salt="t")))
    assert (stored.admitted, used()) == (1, 600)
    response = c.ingest_batches(
        batch("node-a", 2, tier=L2, event_type=ACCESS, entries=stores([1], 999, salt="t")),
        batch("node-a", 3, tier=L2, entries=[]),
        batch("node-a", 4, tier=L2, event_type=DELETE, entries=stores([2], 0, salt="t")),
        batch("node-a", 5, tier=L2, event_type=DELETE, entries=stores([9], 0, salt="t")),
    )
    assert list(response.results) == [ADMITTED] * 4
    assert (response.admitted, response.duplicates, response.stale) == (4, 0, 0)
    assert used() == 300
    assert c.cursors()["node-a"].last_seq == 5
    k1, k2, k9 = c.lookup(pkey(1, salt="t"), pkey(2, salt="t"), pkey(9, salt="t")).results
    assert [(p.size_bytes, k1.access_count) for p in k1.placements] == [(300, 1)]
    assert (list(k2.placements), list(k9.placements)) == ([], [])
    assert c.stats().num_keys == 1


# ---------------------------------------------------------------------------- eviction


def _l2_victims(c: object, plan: policy_pb2.RunEvictionResponse) -> list[tuple[str, int, int]]:
    return [(s.cache_salt, s.victim_keys, s.victim_bytes) for s in plan.plan]


def test_eviction_sends_deletes_down_the_holders_stream(make_coord: CoordFactory) -> None:
    coord = make_coord(eviction_ratio=0.5)
    c = coord.clients
    c.register("node-e")
    node = coord.node("node-e")
    for i in range(1, 5):  # one key per batch: a defined LRU order, k1 oldest
        node.batch(i, tier=L2, entries=stores([i], salt="t"))
    node.wait_acks(4)
    policy = c.policy
    policy.set_quota(policy_pb2.SetQuotaRequest(cache_salt="t", tier=L2, limit_bytes=250))
    dry = policy.run_eviction(policy_pb2.RunEvictionRequest(dry_run=True))
    assert _l2_victims(c, dry) == [("t", 2, 200)]
    assert dry.dispatched_commands == 0
    assert node.deletes() == []
    wait_until(coord.app.core.eviction.is_ready)
    run = policy.run_eviction(policy_pb2.RunEvictionRequest())
    assert run.dispatched_commands == 1
    node.wait(lambda: len(node.deletes()) == 1)
    command = node.deletes()[0]
    assert command.command_id
    delete = command.delete_keys
    assert (delete.tier, delete.backend, delete.force) == (L2, "disk", False)
    assert list(delete.keys) == [pkey(1, salt="t"), pkey(2, salt="t")]
    # Nothing changes until the node reports what it deleted.
    assert {s.cache_salt: s.used_bytes for s in c.usage().salts if s.tier == L2} == {"t": 400}
    assert _l2_victims(c, policy.run_eviction(policy_pb2.RunEvictionRequest(dry_run=True))) == [
        ("t", 2, 200)
    ]
    # Sent victims are not sent again while the node works on them.
    assert policy.run_eviction(policy_pb2.RunEvictionRequest()).dispatched_commands == 0
    node.batch(5, tier=L2, event_type=DELETE, entries=stores([1, 2], size=0, salt="t"))
    node.result(command.command_id, affected=2, effects_through_seq=5)
    assert node.verdicts(5)[4] == (1, 5, ADMITTED)
    assert {s.cache_salt: s.used_bytes for s in c.usage().salts if s.tier == L2} == {"t": 200}
    assert c.lookup(pkey(1, salt="t")).results[0].placements == []
    assert list(policy.run_eviction(policy_pb2.RunEvictionRequest(dry_run=True)).plan) == []
    node.close()


def test_pinned_keys_are_never_victims(make_coord: CoordFactory) -> None:
    coord = make_coord(eviction_ratio=0.5)
    c = coord.clients
    for i in range(1, 5):
        c.ingest_batches(batch("node-e", i, tier=L2, entries=stores([i], salt="t")))
    c.policy.pin_keys(
        policy_pb2.PinKeysRequest(keys=directory_pb2.KeyList(keys=[pkey(1, salt="t")]))
    )
    c.policy.set_quota(policy_pb2.SetQuotaRequest(cache_salt="t", tier=L2, limit_bytes=0))
    # Quota 0: every unpinned key is a victim.
    dry = c.policy.run_eviction(policy_pb2.RunEvictionRequest(dry_run=True))
    assert _l2_victims(c, dry) == [("t", 3, 300)]


def test_eviction_before_ready_is_failed_precondition(make_coord: CoordFactory) -> None:
    coord = make_coord(heartbeat_interval_seconds=20.0, instance_timeout_seconds=60.0)
    c = coord.clients
    c.ingest_batches(batch("node-e", 1, tier=L2, entries=stores([1], salt="t")))
    c.policy.set_quota(policy_pb2.SetQuotaRequest(cache_salt="t", tier=L2, limit_bytes=0))
    error = _error(c.policy.run_eviction, policy_pb2.RunEvictionRequest())
    assert code_of(error) == grpc.StatusCode.FAILED_PRECONDITION
    # A dry run works before readiness.
    dry = c.policy.run_eviction(policy_pb2.RunEvictionRequest(dry_run=True))
    assert _l2_victims(c, dry) == [("t", 1, 100)]
    from kvmesh.api.coordinator.v1 import admin_pb2

    assert not c.admin.get_status(admin_pb2.GetStatusRequest()).ready


# ------------------------------------------------------------------------------ deletes


def _commands(node: RawNode) -> set[tuple[int, str, tuple[int, ...], bool]]:
    return {
        (
            d.delete_keys.tier,
            d.delete_keys.backend,
            tuple(int.from_bytes(k.chunk_hash, "big") for k in d.delete_keys.keys),
            d.delete_keys.force,
        )
        for d in node.deletes()
    }


def test_delete_keys_goes_to_every_holder(coord: Coord) -> None:
    c = coord.clients
    c.register("node-a")
    c.register("node-b")
    a, b = coord.node("node-a"), coord.node("node-b")
    a.batch(1, tier=L1, entries=stores([1]))
    a.batch(2, tier=L2, entries=stores([1]))
    b.batch(1, tier=L2, backend="redis", entries=stores([1]))
    b.batch(2, tier=L1, entries=stores([2]))
    a.wait_acks(2)
    b.wait_acks(2)
    response = c.policy.delete_keys(
        policy_pb2.DeleteKeysRequest(keys=directory_pb2.KeyList(keys=[pkey(1), pkey(2), pkey(3)]))
    )
    assert (response.requested_keys, response.dispatched_keys, response.pin_skipped) == (3, 4, 0)
    a.wait(lambda: len(a.deletes()) == 2)
    b.wait(lambda: len(b.deletes()) == 2)
    assert _commands(a) == {(L1, "dram", (1,), False), (L2, "disk", (1,), False)}
    assert _commands(b) == {(L2, "redis", (1,), False), (L1, "dram", (2,), False)}
    # The directory changes only with the nodes' DELETE events.
    assert len(c.lookup(pkey(1)).results[0].placements) == 3
    a.close()
    b.close()


def test_delete_keys_on_one_node_skips_pins_unless_forced(coord: Coord) -> None:
    c = coord.clients
    c.register("node-a")
    node = coord.node("node-a")
    node.batch(1, tier=L2, entries=stores([1, 2]))
    node.wait_acks(1)
    c.policy.pin_keys(policy_pb2.PinKeysRequest(keys=directory_pb2.KeyList(keys=[pkey(1)])))
    keys = directory_pb2.KeyList(keys=[pkey(1), pkey(2)])
    kept = c.policy.delete_keys(
        policy_pb2.DeleteKeysRequest(instance_id="node-a", keys=keys, tier=L2)
    )
    assert (kept.requested_keys, kept.dispatched_keys, kept.pin_skipped) == (2, 1, 1)
    node.wait(lambda: len(node.deletes()) == 1)
    # Naming the node means every adapter of the tier.
    assert _commands(node) == {(L2, "", (2,), False)}
    forced = c.policy.delete_keys(
        policy_pb2.DeleteKeysRequest(instance_id="node-a", keys=keys, tier=L2, force=True)
    )
    assert (forced.dispatched_keys, forced.pin_skipped) == (2, 0)
    node.wait(lambda: len(node.deletes()) == 2)
    assert (L2, "", (1, 2), True) in _commands(node)
    assert c.policy.list_pins(policy_pb2.ListPinsRequest()).total == 0  # a forced delete unpins
    node.close()


def test_delete_by_tokens_resolves_the_chunks(coord: Coord) -> None:
    c = coord.clients
    c.register("node-a")
    node = coord.node("node-a")
    tokens = list(range(8))
    hashes = token_hashes(tokens, CHUNK)
    node.batch(1, tier=L1, entries=[entry(hkey(h)) for h in hashes])
    node.wait_acks(1)
    response = c.policy.delete_keys(
        policy_pb2.DeleteKeysRequest(
            tokens=directory_pb2.TokenQuery(model_name=MODEL, token_ids=tokens), tier=L1
        )
    )
    assert (response.requested_keys, response.dispatched_keys) == (2, 2)
    node.wait(lambda: len(node.deletes()) == 1)
    assert [k.chunk_hash for k in node.deletes()[0].delete_keys.keys] == hashes
    node.close()


def test_delete_keys_on_an_unknown_or_disconnected_node(coord: Coord) -> None:
    c = coord.clients
    keys = directory_pb2.KeyList(keys=[pkey(1)])
    error = _error(
        c.policy.delete_keys, policy_pb2.DeleteKeysRequest(instance_id="ghost", keys=keys)
    )
    assert code_of(error) == grpc.StatusCode.NOT_FOUND
    c.register("node-c")  # registered, but no event stream open
    error = _error(
        c.policy.delete_keys, policy_pb2.DeleteKeysRequest(instance_id="node-c", keys=keys)
    )
    assert code_of(error) == grpc.StatusCode.UNAVAILABLE
    error = _error(
        c.policy.delete_keys,
        policy_pb2.DeleteKeysRequest(keys=directory_pb2.KeyList(keys=[hkey(b"x")])),
    )
    assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
