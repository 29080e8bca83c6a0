"""The Coordinator facade: wiring order, validation, token lookups, pins, quota views, lifecycle."""

from __future__ import annotations

import pytest

from kvmesh.common.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, IngestResult, Tier
from kvmesh.common.hashing import TokenHasher
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.coordinator.core import Coordinator, CoordinatorSettings
from tests.support.waiting import wait_until
from tests.unit.coordinator.coord_testkit import RecordingDispatcher, Stream, key


def make(**kw: object) -> Coordinator:
    base: dict[str, object] = {"health_check_interval": 0, "eviction_check_interval": 0}
    base.update(kw)
    return Coordinator(CoordinatorSettings(**base))  # type: ignore[arg-type]


def test_consumers_are_wired_directory_before_eviction() -> None:
    """The directory (which feeds usage) runs before the eviction controller."""
    assert make().broadcaster.consumer_names == (
        "KeyDirectory",
        "ServerConfigRegistry",
        "FleetEvictionController",
        "BlendIndex",
    )


def test_ingest_validates_and_applies_nothing_from_a_bad_list() -> None:
    """A malformed batch is INVALID_ARGUMENT and nothing of the list is ingested."""
    c = make()
    good = Stream().store([key(1)])
    bad = CacheEventBatch(
        "node-a", 1, 0, EventType.STORE, Tier.L1, "dram", (CacheEventEntry(key(2)),)
    )
    with pytest.raises(InvalidArgument, match=r"batches\[1\]\.seq"):
        c.ingest_batches([good, bad])
    assert c.stats().num_keys == 0
    assert c.cursors() == {}
    with pytest.raises(InvalidArgument):
        c.ingest(bad)
    assert c.ingest_validated(good) is IngestResult.ADMITTED
    assert c.ingest(good) is IngestResult.DUPLICATE


def test_lookup_tokens_hashes_fans_out_ranks_and_groups() -> None:
    """Chunk-major then rank; sub-chunk input → 0 chunks; bad model rejected."""
    c = make(chunk_size=4)
    tokens = list(range(10))
    hashes = TokenHasher(4).hash_chunks(tokens)
    ranks = [worker_kv_rank(2, r) for r in range(2)]
    stored = ObjectKey(hashes[1], "m", ranks[1], 0, "t")
    other_group = ObjectKey(hashes[0], "m", ranks[0], 3, "t")
    c.ingest(Stream().store([stored, other_group], tier=Tier.L2))
    res = c.lookup_tokens("m", 2, "t", tokens)
    assert res.chunks == 2
    assert [r.key for r in res.results] == [
        ObjectKey(hashes[0], "m", ranks[0], 0, "t"),
        other_group,
        ObjectKey(hashes[0], "m", ranks[1], 0, "t"),
        ObjectKey(hashes[1], "m", ranks[0], 0, "t"),
        stored,
    ]
    assert [bool(r.placements) for r in res.results] == [False, True, False, False, True]
    assert res.cached_prefix_chunks == 0  # chunk 0 has nothing for rank 1
    short = c.lookup_tokens("m", 1, "t", [1, 2, 3])
    assert (short.chunks, short.results) == (0, ())
    with pytest.raises(InvalidArgument):
        c.lookup_tokens("a@b", 1, "", tokens)
    with pytest.raises(InvalidArgument):
        c.lookup_tokens("m", 1, "bad/salt", tokens)
    with pytest.raises(InvalidArgument):
        c.lookup_tokens("m", 0, "", tokens)


def test_too_many_tokens_are_rejected() -> None:
    """More than 10^6 tokens is INVALID_ARGUMENT."""
    with pytest.raises(InvalidArgument, match="token"):
        make().lookup_tokens("m", 1, "", [0] * 1_000_001)


def test_pins_by_tokens_leave_the_plan_and_unpin_restores_them() -> None:
    """Chunk_size 4, 8 tokens → 2 chunks, 2 keys pinned; sub-chunk → 0."""
    c = make(chunk_size=4, eviction_ratio=1.0)
    c.mark_eviction_ready()
    tokens = list(range(8))
    hashes = TokenHasher(4).hash_chunks(tokens)
    keys = [ObjectKey(h, "m", worker_kv_rank(1, 0), 0, "") for h in hashes]
    c.ingest(Stream().store(keys, tier=Tier.L2))
    c.set_quota("", 0)
    result = c.pin_tokens("m", 1, "", tokens)
    assert (result.requested_chunks, result.affected_keys) == (2, 2)
    assert c.plan_eviction() == {}
    page = c.list_pins()
    assert page.total == 2
    assert [p.key for p in page.pins] == keys
    c.unpin_tokens("m", 1, "", tokens)
    assert c.plan_eviction() == {"": keys}
    assert c.pin_tokens("m", 1, "", [1, 2]).affected_keys == 0
    with pytest.raises(InvalidArgument):
        c.pin_tokens("m", 1, "a@b", tokens)


def test_quota_status_views() -> None:
    """L1 never reports a quota; quota-only salts are listed; unknown → zeros."""
    c = make()
    s = Stream()
    c.ingest(s.store([key(1, salt="a")], tier=Tier.L2, size=10))
    c.ingest(s.store([key(2, salt="b")], size=5))
    c.set_quota("q", 0)
    l2 = c.list_quota_status(Tier.L2)
    assert l2.total_bytes == 10
    assert [(x.cache_salt, x.used_bytes, x.quota_exists) for x in l2.by_cache_salt] == [
        ("a", 10, False),
        ("q", 0, True),
    ]
    l1 = c.list_quota_status(Tier.L1)
    assert [(x.cache_salt, x.used_bytes, x.limit_bytes) for x in l1.by_cache_salt] == [
        ("b", 5, None)
    ]
    unknown = c.quota_status("zzz")
    assert (unknown.used_bytes, unknown.limit_bytes, unknown.quota_exists) == (0, None, False)
    assert c.quota_status("q").limit_bytes == 0
    assert c.delete_quota("q") is True
    assert c.delete_quota("q") is False
    assert c.usage_by_salt(Tier.L2) == {"a": 10}


def test_status_reports_cursors_consumers_and_directory() -> None:
    """Kvmesh: one call for ``kvmesh status``."""
    c = make()
    c.ingest(Stream().store([key(1)], seq=3))
    st = c.status()
    assert st.cursors["node-a"].gap_detected is True
    assert st.consumers["KeyDirectory"].batches_delivered == 1
    assert st.directory.num_keys == 1
    assert st.started is False
    assert (st.started_at, st.restored, st.last_checkpoint_time) == (None, False, None)
    assert (st.batches_admitted, st.batches_duplicate, st.chunk_size) == (1, 0, 256)


def test_start_and_stop_run_and_join_every_timer() -> None:
    """Kvmesh: timers start with start(), stop cleanly; stop is idempotent; no restart."""
    c = make(
        health_check_interval=0.01,
        eviction_check_interval=0.01,
        fence_sweep_interval=0.01,
        resync_retry_interval=0.01,
    )
    c.start()
    c.start()
    assert [t.name for t in c.timers] == ["health-sweep", "eviction", "fence-sweep", "resync"]
    assert wait_until(lambda: all(t.runs >= 1 for t in c.timers))
    timers = c.timers
    c.stop()
    c.stop()
    assert all(not t.running for t in timers)
    assert c.timers == ()
    assert c.status().started is False


def test_background_sweep_drains_a_large_fence() -> None:
    """Kvmesh: the fence-sweep timer empties the backlog without any further batch."""
    c = make(fence_sweep_interval=0.01)
    c.directory._fence_sync_keys = 0
    c.directory._reclaim_per_batch = 0
    c.ingest(Stream().store([key(i) for i in range(50)]))
    c.deregister_instance("node-a")
    assert c.stats().fence_backlog_keys == 50
    c.start()
    try:
        assert wait_until(lambda: c.stats().fence_backlog_keys == 0)
    finally:
        c.stop()
    assert c.stats().num_keys == 0


def test_cached_prefix_counts_leading_chunks_held_by_every_rank() -> None:
    """Contract: complete chunks of the prefix with a placement for every kv rank."""
    c = make(chunk_size=2)
    tokens = list(range(8))
    hashes = TokenHasher(2).hash_chunks(tokens)
    ranks = [worker_kv_rank(2, r) for r in range(2)]
    held = [ObjectKey(hashes[0], "m", r) for r in ranks] + [ObjectKey(hashes[1], "m", ranks[0])]
    held += [ObjectKey(hashes[2], "m", r) for r in ranks]
    c.ingest(Stream().store(held))
    assert c.lookup_tokens("m", 2, "", tokens).cached_prefix_chunks == 1
    c.ingest(Stream("node-b").store([ObjectKey(hashes[1], "m", ranks[1], 4)]))
    assert c.lookup_tokens("m", 2, "", tokens).cached_prefix_chunks == 3


def test_delete_keys_goes_to_holders_skips_pins_and_force_drops_them() -> None:
    """DeleteKeys: holders per tier and backend; pinned skipped unless force; force unpins."""
    disp = RecordingDispatcher()
    c = make()
    c.set_delete_dispatcher(disp)
    a, b = Stream("node-a"), Stream("node-b")
    c.ingest(a.store([key(1), key(2)]))
    c.ingest(b.store([key(1)], tier=Tier.L2, backend="s3"))
    c.ingest(a.store([key(3, group=2)], tier=Tier.L2))
    for iid in ("node-a", "node-b"):
        c.register_instance(iid)
    c.pin_keys([key(2)])
    result = c.delete_keys([key(1), key(2), key(3)])
    assert (result.requested_keys, result.pin_skipped) == (3, 1)
    assert sorted((call[0], call[1], call[2], call[3]) for call in disp.calls) == [
        ("node-a", Tier.L1, "dram", (key(1),)),
        ("node-a", Tier.L2, "fs", (key(3, group=2),)),
        ("node-b", Tier.L2, "s3", (key(1),)),
    ]
    assert result.dispatched_keys == 3
    disp.calls.clear()
    forced = c.delete_keys([key(2)], instance_id="node-a", tier=Tier.L2, force=True)
    assert disp.calls == [("node-a", Tier.L2, "", (key(2),))]
    assert disp.forced[-1] is True
    assert forced.pin_skipped == 0
    assert not c.pins.is_pinned(key(2))


def test_delete_keys_errors_for_unknown_or_unreachable_instance() -> None:
    """DeleteKeys: NOT_FOUND for an unregistered id, UNAVAILABLE when the node takes nothing."""
    c = make()
    c.set_delete_dispatcher(RecordingDispatcher(accept=False))
    with pytest.raises(NotFound):
        c.delete_keys([key(1)], instance_id="ghost")
    c.register_instance("node-a")
    with pytest.raises(Unavailable):
        c.delete_keys([key(1)], instance_id="node-a", tier=Tier.L1)
    tokens = c.delete_tokens("m", 1, "", [1, 2, 3])
    assert (tokens.requested_keys, tokens.dispatched_keys) == (0, 0)


def test_dry_run_eviction_plans_with_bytes_and_sends_nothing() -> None:
    """RunEviction(dry_run): allowed before readiness; reports victim bytes."""
    disp = RecordingDispatcher()
    c = make(eviction_ratio=1.0)
    c.set_delete_dispatcher(disp)
    c.register_instance("node-a")
    c.ingest(Stream().store([key(1), key(2)], tier=Tier.L2, size=100))
    c.set_quota("", 0)
    report = c.run_eviction(dry_run=True)
    assert report.dry_run is True
    assert report.ready is False
    assert report.plan_bytes == {"": 200}
    assert sorted(report.plan[""]) == sorted([key(1), key(2)])
    assert disp.calls == []
    assert c.run_eviction().ready is False


def test_pins_page_with_tokens() -> None:
    """ListPins: page_token walks the first-pinned order; a bad token is INVALID_ARGUMENT."""
    c = make()
    c.pin_keys([key(i) for i in range(5)])
    first = c.list_pins(limit=2)
    assert [p.key for p in first.pins] == [key(0), key(1)]
    assert first.total == 5
    rest = c.list_pins(limit=10, page_token=first.next_page_token)
    assert [p.key for p in rest.pins] == [key(2), key(3), key(4)]
    assert rest.next_page_token == ""
    with pytest.raises(InvalidArgument):
        c.list_pins(page_token="x")
    with pytest.raises(InvalidArgument):
        c.list_pins(limit=10_001)
