"""KeyDirectory (docs/coordinator.md, "Key directory") plus kvmesh's storage guarantees."""

from __future__ import annotations

import gc

import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import (
    CacheEventBatch,
    CacheEventEntry,
    EventType,
    Tier,
    validate_batch,
)
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.coordinator.core import CacheUsageManager, KeyDirectory, KeySpaces
from kvmesh.coordinator.core.types import Placement
from tests.unit.coordinator.coord_testkit import Stream, h, key


def make() -> KeyDirectory:
    return KeyDirectory(KeySpaces(), CacheUsageManager())


def apply(d: KeyDirectory, *batches: CacheEventBatch) -> None:
    for b in batches:
        d.consume(b)


def placements(d: KeyDirectory, k: ObjectKey) -> tuple[Placement, ...]:
    return d.lookup([k])[0].placements


def test_store_then_lookup_returns_the_placement() -> None:
    d = make()
    apply(d, Stream().store([key(1)], size=1024))
    assert placements(d, key(1)) == (Placement("node-a", 1, Tier.L1, "dram", 1024, False),)


def test_unknown_key_gives_empty_placements_in_request_order() -> None:
    d = make()
    apply(d, Stream().store([key(2)]))
    res = d.lookup([key(1), key(2), key(3)])
    assert [r.key for r in res] == [key(1), key(2), key(3)]
    assert [len(r.placements) for r in res] == [0, 1, 0]


def test_restore_of_same_identity_replaces_size() -> None:
    """Size 100 then 200 → one placement of 200."""
    d = make()
    s = Stream()
    apply(d, s.store([key(1)], size=100), s.store([key(1)], size=200))
    assert [p.size_bytes for p in placements(d, key(1))] == [200]
    assert d.stats().l1.size_bytes == 200


def test_two_instances_give_two_placements_sorted_by_instance() -> None:
    d = make()
    apply(d, Stream("node-b").store([key(1)]), Stream("node-a").store([key(1)]))
    assert [p.instance_id for p in placements(d, key(1))] == ["node-a", "node-b"]


def test_l1_and_l2_of_one_instance_sorted_l1_first() -> None:
    d = make()
    s = Stream()
    apply(d, s.store([key(1)], tier=Tier.L2), s.store([key(1)], tier=Tier.L1))
    assert [(p.tier, p.backend) for p in placements(d, key(1))] == [
        (Tier.L1, "dram"),
        (Tier.L2, "fs"),
    ]


def test_delete_removes_placement_and_empty_record() -> None:
    d = make()
    s = Stream()
    apply(d, s.store([key(1)]), s.delete([key(1)]))
    st = d.stats()
    assert (st.num_keys, st.num_placements) == (0, 0)
    assert st.l1_keys_by_instance["node-a"] == 0


def test_l1_delete_keeps_l2_and_leaves_the_l1_index() -> None:
    d = make()
    s = Stream()
    apply(d, s.store([key(1)], tier=Tier.L2), s.store([key(1)]), s.delete([key(1)]))
    assert [p.tier for p in placements(d, key(1))] == [Tier.L2]
    assert d.stats().l1_keys_by_instance["node-a"] == 0


def test_delete_of_unknown_key_does_nothing() -> None:
    d = make()
    s = Stream()
    apply(d, s.store([key(1)]), s.delete([key(2)]), Stream("node-b").delete([key(1)]))
    assert d.stats().num_keys == 1
    assert len(placements(d, key(1))) == 1


def test_access_never_creates_a_record() -> None:
    d = make()
    apply(d, Stream().access([key(1)], ts=5.0))
    assert d.stats().num_keys == 0
    assert placements(d, key(1)) == ()


def test_access_with_empty_backend_refreshes_without_touching_placements() -> None:
    """access_count grows by one per entry; last_access is the latest."""
    d = make()
    s = Stream()
    apply(d, s.store([key(1)], ts=10.0))
    before = placements(d, key(1))
    apply(d, s.access([key(1), key(1)], ts=20.0), s.access([key(1)], ts=15.0, tier=Tier.L2))
    info = d.lookup([key(1)])[0]
    assert info.placements == before
    assert info.access_count == 3
    assert info.last_access == 20.0
    assert d.get_access_counts([key(1), key(9)]) == [3, 0]


def test_store_or_delete_with_empty_backend_is_rejected() -> None:
    """Validation at the edge rejects it (the core is never handed one)."""
    for et in (EventType.STORE, EventType.DELETE):
        batch = CacheEventBatch("node-a", 1, 1, et, Tier.L1, "", (CacheEventEntry(key(1)),))
        with pytest.raises(InvalidArgument, match="backend"):
            validate_batch(batch)


def test_fence_drops_only_the_fenced_instances_l1() -> None:
    """K1 keeps node-b only, k2 is gone, node-a leaves the index."""
    d = make()
    apply(d, Stream("node-a").store([key(1), key(2)]), Stream("node-b").store([key(1)]))
    d.fence_instance("node-a")
    assert [p.instance_id for p in placements(d, key(1))] == ["node-b"]
    assert placements(d, key(2)) == ()
    assert "node-a" not in d.stats().l1_keys_by_instance
    assert d.stats().num_keys == 1


def test_fence_of_unknown_instance_does_nothing() -> None:
    d = make()
    apply(d, Stream().store([key(1)]))
    d.fence_instance("ghost")
    assert d.stats().num_keys == 1


def test_binding_filled_by_store_and_released_with_last_key() -> None:
    """Rank-0 and rank-1 keys share one binding until both are gone."""
    d = make()
    s = Stream()
    r0 = ObjectKey(h(1), "m", worker_kv_rank(2, 0))
    r1 = ObjectKey(h(1), "m", worker_kv_rank(2, 1))
    toks = list(range(8))
    apply(d, s.store([r0, r1], tokens=toks, token_offset=0))
    assert d.get_token_ids([h(1)]) == [tuple(toks)]
    apply(d, s.delete([r0]))
    assert d.get_token_ids([h(1)]) == [tuple(toks)]
    apply(d, s.delete([r1]))
    assert d.get_token_ids([h(1)]) == [()]
    assert d.stats().token_bindings == 0


def test_chunks_bind_independently() -> None:
    d = make()
    s = Stream()
    apply(d, s.store([key(1)], tokens=[1, 2]), s.store([key(2)], tokens=[3, 4]))
    apply(d, s.delete([key(1)]))
    assert d.get_token_ids([h(1), h(2)]) == [(), (3, 4)]


def test_tokenless_store_then_stamped_store_fills_the_binding() -> None:
    d = make()
    s = Stream()
    apply(d, s.store([key(1)]))
    assert d.get_token_ids([h(1)]) == [()]
    assert d.lookup([key(1)])[0].token_ids == ()
    apply(d, s.store([key(1)], tokens=[5, 6, 7], token_offset=256))
    assert d.get_token_binding(h(1)) == ((5, 6, 7), 256)
    assert d.lookup([key(1)])[0].token_ids == (5, 6, 7)


def test_restore_with_new_tokens_replaces_the_content() -> None:
    d = make()
    s = Stream()
    apply(d, s.store([key(1)], tokens=[1, 2, 3]), s.store([key(1)], tokens=[7, 8, 9]))
    assert d.get_token_ids([h(1)]) == [(7, 8, 9)]


def test_tokens_outside_uint32_leave_binding_unfilled_but_apply_placement() -> None:
    """Then a well-formed store repairs the binding."""
    d = make()
    s = Stream()
    apply(d, s.store([key(1)], tokens=[1, 2**32]))
    assert len(placements(d, key(1))) == 1
    assert d.get_token_ids([h(1)]) == [()]
    apply(d, s.store([key(1)], tokens=[1, 2]))
    assert d.get_token_ids([h(1)]) == [(1, 2)]


def test_token_offset_below_minus_one_rejected_and_default_is_unknown() -> None:
    bad = Stream().store([key(1)], tokens=[1], token_offset=-2)
    with pytest.raises(InvalidArgument, match="token_offset"):
        validate_batch(bad)
    assert CacheEventEntry(key(1)).token_offset == -1
    d = make()
    apply(d, Stream().store([key(1)], tokens=[1, 2]))
    assert d.get_token_binding(h(1)) == ((1, 2), -1)


def test_fence_releases_bindings() -> None:
    d = make()
    apply(d, Stream().store([key(1)], tokens=[1, 2]))
    d.fence_instance("node-a")
    assert d.get_token_ids([h(1)]) == [()]


def test_list_keys_totals_filters_and_pages() -> None:
    """Totals, tier / instance / backend filters (placements filtered), paging."""
    d = make()
    a, b = Stream("node-a"), Stream("node-b")
    apply(
        d,
        a.store([key(i) for i in range(10)]),
        a.store([key(i) for i in range(5)], tier=Tier.L2),
        b.store([key(i) for i in range(3)], tier=Tier.L2, backend="s3"),
    )
    everything = d.list_keys(limit=100)
    assert everything.total == 10
    assert len(everything.entries) == 10
    assert everything.next_page_token == ""
    l2 = d.list_keys(tier=Tier.L2, limit=100)
    assert l2.total is None
    assert len(l2.entries) == 5
    assert all(p.tier == Tier.L2 for e in l2.entries for p in e.placements)
    only_b = d.list_keys(instance_id="node-b", limit=100)
    assert sorted(e.key for e in only_b.entries) == sorted(key(i) for i in range(3))
    assert all(p.instance_id == "node-b" for e in only_b.entries for p in e.placements)
    s3 = d.list_keys(backend="s3", limit=100)
    assert len(s3.entries) == 3
    seen: list[ObjectKey] = []
    token = ""
    while True:
        page = d.list_keys(limit=3, page_token=token)
        assert page.total == 10
        seen.extend(e.key for e in page.entries)
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == sorted(key(i) for i in range(10))
    assert len(seen) == 10


def test_list_keys_rejects_bad_limit_and_token() -> None:
    """A bad limit or page token raises InvalidArgument."""
    d = make()
    for limit in (0, -1, 10_001):
        with pytest.raises(InvalidArgument):
            d.list_keys(limit=limit)
    with pytest.raises(InvalidArgument, match="page token"):
        d.list_keys(page_token="not base64 at all!")
    other = make()
    apply(other, Stream().store([key(1), key(2)]))
    foreign = other.list_keys(limit=1).next_page_token
    with pytest.raises(InvalidArgument, match="another coordinator"):
        d.list_keys(page_token=foreign)


def test_paging_is_stable_while_keys_change() -> None:
    """Kvmesh: keys present throughout are listed exactly once despite inserts and deletes."""
    d = make()
    s = Stream()
    apply(d, s.store([key(i) for i in range(200)]))
    seen: list[ObjectKey] = []
    token = ""
    step = 0
    while True:
        page = d.list_keys(limit=7, page_token=token)
        seen.extend(e.key for e in page.entries)
        token = page.next_page_token
        # Churn between pages: delete some old keys, add new ones.
        apply(d, s.delete([key(step)]), s.store([key(1000 + step)]))
        step += 1
        if not token:
            break
    survivors = {key(i) for i in range(step, 200)}
    assert survivors <= set(seen)
    assert len(seen) == len(set(seen))


def test_list_keys_bounds_the_work_per_call() -> None:
    """Kvmesh: with a selective filter a page may come back short but with a token."""
    d = make()
    apply(d, Stream().store([key(i) for i in range(50)]))
    page = d.list_keys(backend="nowhere", limit=5, max_scan=10)
    assert page.entries == ()
    assert page.next_page_token != ""


def test_batch_invariants_are_enforced_at_the_edge() -> None:
    """Tier must be concrete, seq >= 1, size >= 0, instance id non-empty."""
    base = Stream().store([key(1)])
    bad = [
        CacheEventBatch("node-a", 1, 1, EventType.STORE, 3, "dram", base.entries),  # type: ignore[arg-type]
        CacheEventBatch("node-a", 1, 0, EventType.STORE, Tier.L1, "dram", base.entries),
        CacheEventBatch(
            "node-a", 1, 1, EventType.STORE, Tier.L1, "dram", (CacheEventEntry(key(1), -1),)
        ),
        CacheEventBatch("", 1, 1, EventType.STORE, Tier.L1, "dram", base.entries),
    ]
    messages = ["concrete tier", "seq", "size_bytes", "instance_id"]
    for batch, msg in zip(bad, messages, strict=True):
        with pytest.raises(InvalidArgument, match=msg):
            validate_batch(batch)


def test_stats_count_keys_placements_and_l1_index_per_instance() -> None:
    """2 keys, 3 placements; a=2, b=0 when b only reported L2."""
    d = make()
    apply(
        d,
        Stream("node-a").store([key(1), key(2)], size=10),
        Stream("node-b").store([key(1)], tier=Tier.L2, size=30),
    )
    st = d.stats()
    assert (st.num_keys, st.num_placements) == (2, 3)
    assert dict(st.l1_keys_by_instance) == {"node-a": 2, "node-b": 0}
    assert (st.l1.count, st.l1.size_bytes, st.l2.count, st.l2.size_bytes) == (2, 20, 1, 30)


def test_shared_pool_has_one_placement_naming_the_last_reporter() -> None:
    """Any reporter — or a controller stream under its own id — deletes it."""
    d = make()
    a, b, ctl = Stream("node-a"), Stream("node-b", incarnation=4), Stream("pool-ctl")
    apply(
        d,
        a.store([key(1)], tier=Tier.L2, backend="s3", shared=True),
        b.store([key(1)], tier=Tier.L2, backend="s3", shared=True),
    )
    assert placements(d, key(1)) == (Placement("node-b", 4, Tier.L2, "s3", 1024, True),)
    apply(d, a.delete([key(1)], tier=Tier.L2, backend="s3", shared=True))
    assert placements(d, key(1)) == ()
    apply(d, a.store([key(2)], tier=Tier.L2, backend="s3", shared=True))
    apply(d, ctl.delete([key(2)], tier=Tier.L2, backend="s3", shared=True))
    assert placements(d, key(2)) == ()


def test_fence_follows_the_recorded_reporter_of_shared_placements() -> None:
    """Shared L1 of the fenced reporter goes; L2 and re-reported shared survive."""
    d = make()
    ctl, a, b = Stream("pool-ctl"), Stream("node-a"), Stream("node-b")
    apply(
        d,
        ctl.store([key(1)], backend="cxl", shared=True),
        b.store([key(2)], tier=Tier.L2, backend="fs"),
        b.store([key(3)], tier=Tier.L2, backend="s3", shared=True),
        a.store([key(4)], backend="cxl", shared=True),
        b.store([key(4)], backend="cxl", shared=True),
    )
    d.fence_instance("pool-ctl")
    d.fence_instance("node-b")  # its private fs and shared s3 placements are L2
    assert placements(d, key(1)) == ()
    assert len(placements(d, key(2))) == 1
    assert len(placements(d, key(3))) == 1
    d2 = make()
    apply(
        d2,
        Stream("node-a").store([key(4)], backend="cxl", shared=True),
        Stream("node-b").store([key(4)], backend="cxl", shared=True),
    )
    d2.fence_instance("node-a")
    assert [p.instance_id for p in placements(d2, key(4))] == ["node-b"]


def test_private_and_shared_on_same_tier_backend_are_separate() -> None:
    d = make()
    s = Stream()
    apply(
        d,
        s.store([key(1)], tier=Tier.L2, backend="fs"),
        s.store([key(1)], tier=Tier.L2, backend="fs", shared=True),
    )
    assert sorted(p.shared for p in placements(d, key(1))) == [False, True]
    apply(d, s.delete([key(1)], tier=Tier.L2, backend="fs", shared=True))
    assert [p.shared for p in placements(d, key(1))] == [False]


def test_keys_across_object_groups_and_key_bytes() -> None:
    """Sibling groups are found; key_bytes sums a tier's placements."""
    d = make()
    s = Stream()
    g0, g2 = key(1, group=0), key(1, group=2)
    apply(
        d,
        s.store([g2], tier=Tier.L2, size=5),
        s.store([g2], tier=Tier.L2, backend="s3", size=7),
        s.store([key(2)], size=1),
    )
    assert d.get_keys_across_object_groups([g0, key(3)]) == [[g0, g2], [key(3)]]
    assert d.key_bytes(Tier.L2, g2) == 12
    assert d.key_bytes(Tier.L1, g2) == 0


def test_salt_and_model_are_part_of_identity() -> None:
    """The same hash in another tenant or model is another key."""
    d = make()
    apply(d, Stream().store([key(1, salt="t1")]))
    assert placements(d, key(1, salt="t2")) == ()
    assert placements(d, key(1, model="other")) == ()
    assert len(placements(d, key(1, salt="t1"))) == 1


def test_big_tables_hold_no_gc_tracked_objects() -> None:
    """Kvmesh: shards and reverse index stay untracked, so full GCs do not grow with them."""
    d = make()
    s = Stream()
    apply(
        d,
        s.store([key(i) for i in range(500)]),
        s.store([key(i) for i in range(500)], tier=Tier.L2),
        s.access([key(i) for i in range(100)]),
        s.delete([key(i) for i in range(50)]),
    )
    gc.collect()
    assert d.is_gc_untracked()
    assert not any(gc.is_tracked(v) for shard in d._shards for v in shard.values())


def test_binding_cap_bounds_token_memory() -> None:
    """Kvmesh: at most ``token_binding_cap`` bindings; the oldest go first; 0 disables."""
    d = KeyDirectory(KeySpaces(), token_binding_cap=8)
    s = Stream()
    for i in range(20):
        apply(d, s.store([key(i)], tokens=[i, i + 1]))
    st = d.stats()
    assert st.token_bindings <= 8
    assert d.get_token_ids([h(19)]) == [(19, 20)]
    assert d.get_token_ids([h(0)]) == [()]
    assert st.num_keys == 20
    off = KeyDirectory(KeySpaces(), token_binding_cap=0)
    apply(off, s.store([key(1)], tokens=[1]))
    assert off.stats().token_bindings == 0


def test_capture_is_unchanged_by_later_writes() -> None:
    """For the directory: copy-on-write shards keep the capture frozen."""
    d = make()
    s = Stream()
    apply(d, s.store([key(1), key(2)]))
    cap = d.capture()
    frozen = {k: dict(v) for k, v in enumerate(cap["shards"]) if v}  # type: ignore[arg-type]
    apply(d, s.store([key(3)]), s.delete([key(1)]), s.access([key(2)], ts=9.0))
    after = {k: dict(v) for k, v in enumerate(cap["shards"]) if v}  # type: ignore[arg-type]
    assert after == frozen
    assert d.stats().num_keys == 2


def test_restore_rebuilds_index_totals_usage_and_bindings() -> None:
    """Durable component: a capture restores into a fresh directory and usage view."""
    d = make()
    a = Stream("node-a", incarnation=3)
    apply(
        d,
        a.store([key(1)], size=100, tokens=[1, 2]),
        a.store([key(1), key(2)], tier=Tier.L2, size=1000, ts=4.0),
        Stream("node-b").store([key(3)], tier=Tier.L2, backend="s3", shared=True, size=7),
        a.access([key(1)], ts=5.0),
    )
    cap = d.capture()
    fresh = KeyDirectory(KeySpaces(), CacheUsageManager())
    fresh.restore(cap)
    assert fresh.stats() == d.stats()
    assert fresh.lookup([key(1), key(2), key(3)]) == d.lookup([key(1), key(2), key(3)])
    assert fresh.usage.get_bytes_by_instance(Tier.L2) == d.usage.get_bytes_by_instance(Tier.L2)
    assert fresh.usage.get_salt_bytes(Tier.L1, "") == 100
    fresh.fence_instance("node-a")
    assert [p.tier for p in fresh.lookup([key(1)])[0].placements] == [Tier.L2]
    with pytest.raises(ValueError, match="empty directory"):
        fresh.restore(cap)


def test_restore_translates_key_spaces_of_a_codec_in_use() -> None:
    """Kvmesh: sections store their space table; ids are remapped on restore."""
    d = make()
    apply(d, Stream().store([key(1, salt="t1"), key(2, model="x")]))
    cap = d.capture()
    spaces = KeySpaces()
    spaces.intern(("other", 1, 0, "z"))  # occupy id 0 with something else
    fresh = KeyDirectory(spaces)
    fresh.restore(cap)
    assert len(fresh.lookup([key(1, salt="t1")])[0].placements) == 1
    assert len(fresh.lookup([key(2, model="x")])[0].placements) == 1


def test_bad_restore_leaves_the_directory_untouched() -> None:
    """A malformed section raises and nothing is half-loaded."""
    d = make()
    apply(d, Stream().store([key(1)]))
    cap = d.capture()
    cap["shards"] = [{b"x" * 36: b"short"}]
    fresh = make()
    with pytest.raises(ValueError, match="malformed"):
        fresh.restore(cap)
    assert fresh.stats().num_keys == 0
    bad_tier = d.capture()
    bad_tier["identities"] = [[3, "dram", False, "node-a"]]
    with pytest.raises(ValueError, match="tier"):
        make().restore(bad_tier)
