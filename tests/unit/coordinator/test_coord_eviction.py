"""Fleet eviction: quotas, LRU, pins, deletes (docs/coordinator.md, "Fleet eviction")."""

from __future__ import annotations

import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import CacheEventBatch, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.core import (
    Coordinator,
    CoordinatorSettings,
    PinTable,
    QuotaManager,
)
from kvmesh.coordinator.core.scheduler import PeriodicTask
from tests.support.waiting import wait_until
from tests.unit.coordinator.coord_testkit import FakeClock, RecordingDispatcher, Stream, key


def make(
    *,
    ratio: float = 1.0,
    watermark: float = 1.0,
    max_delete_batch: int = 10_000,
    dispatcher: RecordingDispatcher | None = None,
    clock: FakeClock | None = None,
    ready: bool = True,
) -> Coordinator:
    c = Coordinator(
        CoordinatorSettings(
            eviction_ratio=ratio,
            trigger_watermark=watermark,
            max_delete_batch=max_delete_batch,
            health_check_interval=0,
            eviction_check_interval=0,
        ),
        dispatcher=dispatcher,
        clock=clock or FakeClock(),
    )
    if ready:
        c.mark_eviction_ready()
    return c


def l2(c: Coordinator, *batches: CacheEventBatch) -> None:
    for b in batches:
        c.ingest(b)


def victims(c: Coordinator, salt: str = "") -> list[ObjectKey]:
    return c.plan_eviction().get(salt, [])


def test_stores_are_plannable_and_a_lookup_touch_reorders() -> None:
    """After touching k1, k2 is the first victim; unknown keys are not tracked."""
    c = make(ratio=0.5)
    s = Stream()
    c.set_quota("", 0)
    l2(c, s.store([key(1)], tier=Tier.L2), s.store([key(2)], tier=Tier.L2))
    assert c.lru.order("") == [key(1), key(2)]
    l2(c, s.access([key(1), key(9)], tier=Tier.L2, backend="fs"))
    assert c.lru.order("") == [key(2), key(1)]
    assert victims(c) == [key(2), key(1)]  # quota 0 → ratio 1.0
    c.set_quota("", 1)
    assert victims(c) == [key(2)]


def test_delete_removes_key_from_lru_and_usage() -> None:
    """An emptied salt leaves the plan empty."""
    c = make()
    s = Stream()
    c.set_quota("", 0)
    l2(c, s.store([key(1)], tier=Tier.L2), s.delete([key(1)], tier=Tier.L2))
    assert c.lru.order("") == []
    assert c.usage.get_salt_bytes(Tier.L2, "") == 0
    assert c.plan_eviction() == {}


def test_default_quota_none_exempts_and_explicit_values_arm_eviction() -> None:
    """None exempts; explicit quota enforced under None; 0 arms; >0 is a budget."""
    c = make()
    s = Stream()
    l2(
        c,
        s.store([key(1, salt="a")], tier=Tier.L2, size=100),
        s.store([key(2, salt="b")], tier=Tier.L2, size=100),
    )
    assert c.get_default_quota() is None
    assert c.plan_eviction() == {}
    c.set_quota("a", 50)
    assert set(c.plan_eviction()) == {"a"}
    c.set_default_quota(0)
    assert set(c.plan_eviction()) == {"a", "b"}
    c.set_default_quota(1000)
    assert set(c.plan_eviction()) == {"a"}


def test_plan_respects_quota_ratio_and_watermark() -> None:
    """Under quota none; 0.5 → oldest of 2; quota 0 all; salts independent; watermark."""
    c = make(ratio=0.5)
    s = Stream()
    l2(c, s.store([key(1)], tier=Tier.L2, size=100), s.store([key(2)], tier=Tier.L2, size=100))
    c.set_quota("", 1000)
    assert victims(c) == []
    c.set_quota("", 150)
    assert victims(c) == [key(1)]
    c.set_quota("", 0)
    assert victims(c) == [key(1), key(2)]
    full = make(ratio=1.0)
    l2(full, s.store([key(3, salt="x")], tier=Tier.L2, size=10))
    full.set_quota("x", 5)
    full.set_quota("y", 5)
    assert full.plan_eviction() == {"x": [key(3, salt="x")]}
    wm = make(ratio=1.0, watermark=0.8)
    w = Stream("node-w")
    wm.set_quota("", 1000)
    l2(wm, w.store([key(1)], tier=Tier.L2, size=700))
    assert wm.plan_eviction() == {}
    l2(wm, w.store([key(2)], tier=Tier.L2, size=200))
    assert wm.plan_eviction() == {"": [key(1), key(2)]}


def test_execute_sends_victims_to_their_holder_and_changes_nothing_locally() -> None:
    """One delete to the owner, exact keys, tier L2, the placement's backend."""
    disp = RecordingDispatcher()
    c = make(dispatcher=disp)
    c.register_instance("node-a")
    l2(c, Stream().store([key(1)], tier=Tier.L2, size=10))
    c.set_quota("", 0)
    report = c.run_eviction()
    assert disp.calls == [("node-a", Tier.L2, "fs", (key(1),))]
    assert report.plan == {"": (key(1),)}
    assert [r.accepted for r in report.requests] == [True]
    assert c.lru.order("") == [key(1)]
    assert c.usage.get_salt_bytes(Tier.L2, "") == 10


def test_unregistered_holder_or_refused_dispatch_repeats_next_cycle() -> None:
    """No live holder → nothing sent; a refused dispatch leaves the LRU as is."""
    disp = RecordingDispatcher(accept=False)
    c = make(dispatcher=disp)
    l2(c, Stream().store([key(1)], tier=Tier.L2, size=10))
    c.set_quota("", 0)
    report = c.run_eviction()
    assert disp.calls == []
    assert report.undeliverable == 1
    c.register_instance("node-a")
    for _ in range(2):
        report = c.run_eviction()
        assert [r.accepted for r in report.requests] == [False]
    assert len(disp.calls) == 2
    assert c.lru.order("") == [key(1)]


def test_deletes_are_chunked_at_max_delete_batch() -> None:
    """With the batch limit 2, five keys go out as 2, 2 and 1."""
    disp = RecordingDispatcher()
    c = make(dispatcher=disp, max_delete_batch=2)
    c.register_instance("node-a")
    s = Stream()
    for i in range(5):
        l2(c, s.store([key(i)], tier=Tier.L2))
    c.set_quota("", 0)
    c.run_eviction()
    assert [len(call[3]) for call in disp.calls] == [2, 2, 1]
    assert [k for call in disp.calls for k in call[3]] == [key(i) for i in range(5)]


def test_empty_plan_dispatches_nothing() -> None:
    disp = RecordingDispatcher()
    c = make(dispatcher=disp)
    c.register_instance("node-a")
    l2(c, Stream().store([key(1)], tier=Tier.L2))
    report = c.run_eviction()
    assert report.plan == {}
    assert disp.calls == []


def test_pins_exclude_keys_and_are_reference_counted() -> None:
    """Pinned keys skipped; two pins need two unpins; order kept; drop clears."""
    c = make()
    s = Stream()
    l2(c, s.store([key(1)], tier=Tier.L2), s.store([key(2)], tier=Tier.L2))
    c.set_quota("", 0)
    c.pin_keys([key(1), key(1)])
    assert victims(c) == [key(2)]
    c.unpin_keys([key(1)])
    assert victims(c) == [key(2)]
    c.unpin_keys([key(1), key(7)])
    assert victims(c) == [key(1), key(2)]
    pins = PinTable()
    pins.pin([key(3), key(1, group=5)])  # any group pins the chunk key
    assert pins.is_pinned(key(1, group=0))
    assert pins.filter_unpinned([key(2), key(1), key(4), key(3)]) == [key(2), key(4)]
    assert pins.drop_pins([key(1), key(8)]) == 1
    assert not pins.is_pinned(key(1))
    pins.unpin([key(8)])
    assert pins.pin_count(key(8)) == 0


def test_consume_tracks_l2_only_and_keeps_key_while_another_copy_holds_bytes() -> None:
    """STORE registers, ACCESS touches, DELETE drops once no L2 copy remains."""
    c = make()
    a, b = Stream("node-a"), Stream("node-b")
    l2(
        c,
        a.store([key(1)], tier=Tier.L2),
        b.store([key(1)], tier=Tier.L2),
        a.store([key(2)]),  # L1: not in the LRU, but counted as L1 usage
    )
    assert c.lru.order("") == [key(1)]
    assert c.usage.get_salt_bytes(Tier.L1, "") == 1024
    l2(c, a.delete([key(1)], tier=Tier.L2))
    assert c.lru.order("") == [key(1)]
    l2(c, b.delete([key(1)], tier=Tier.L2))
    assert c.lru.order("") == []


def test_fence_keeps_l2_usage_and_lru() -> None:
    c = make()
    l2(c, Stream().store([key(1)], tier=Tier.L2, size=10))
    c.gate.drop_instance("node-a")
    assert c.lru.order("") == [key(1)]
    assert c.usage.get_salt_bytes(Tier.L2, "") == 10


def test_eviction_loop_sleeps_first_then_runs_every_interval() -> None:
    """Nothing within the first interval; then one cycle per tick until stopped."""
    disp = RecordingDispatcher()
    c = make(dispatcher=disp)
    c.register_instance("node-a")
    l2(c, Stream().store([key(1)], tier=Tier.L2))
    c.set_quota("", 0)
    slow = PeriodicTask("eviction", 30.0, c.run_eviction)
    slow.start()
    slow.stop()
    assert slow.runs == 0
    assert disp.calls == []
    fast = PeriodicTask("eviction", 0.01, c.run_eviction)
    fast.start()
    try:
        assert wait_until(lambda: len(disp.calls) >= 1)
    finally:
        assert fast.stop()
    assert not fast.running


def test_nothing_is_evicted_before_one_heartbeat_period() -> None:
    """Kvmesh readiness gate: a cold or restored coordinator never mass-evicts at once."""
    clock = FakeClock()
    disp = RecordingDispatcher()
    c = make(dispatcher=disp, clock=clock, ready=False)
    c.start()
    try:
        c.register_instance("node-a")
        l2(c, Stream().store([key(1)], tier=Tier.L2))
        c.set_default_quota(0)
        report = c.run_eviction()
        assert report.ready is False
        assert disp.calls == []
        clock.advance(c.settings.heartbeat_interval)
        assert c.run_eviction().ready is True
        assert len(disp.calls) == 1
    finally:
        c.stop()


def test_victims_in_flight_count_but_are_not_resent_until_expiry() -> None:
    """Kvmesh: a sent victim is not re-sent every cycle; it is once the redispatch time passed."""
    clock = FakeClock()
    disp = RecordingDispatcher()
    c = make(dispatcher=disp, clock=clock)
    c.register_instance("node-a")
    l2(c, Stream().store([key(1)], tier=Tier.L2))
    c.set_quota("", 0)
    c.run_eviction()
    second = c.run_eviction()
    assert len(disp.calls) == 1
    assert second.keys_in_flight == 1
    assert second.plan == {"": (key(1),)}
    clock.advance(c.settings.redispatch_after + 1)
    c.run_eviction()
    assert len(disp.calls) == 2


def test_each_copy_goes_to_an_instance_that_holds_it() -> None:
    """Kvmesh: private copies to each owner; a shared copy to a live reporter of the pool."""
    disp = RecordingDispatcher()
    c = make(dispatcher=disp)
    a, b = Stream("node-a"), Stream("node-b")
    l2(
        c,
        a.store([key(1)], tier=Tier.L2, backend="fs"),
        b.store([key(1)], tier=Tier.L2, backend="nvme"),
        a.store([key(1)], tier=Tier.L2, backend="s3", shared=True),
        b.store([key(1)], tier=Tier.L2, backend="s3", shared=True),
    )
    c.register_instance("node-a")
    c.register_instance("node-b")
    c.set_quota("", 0)
    c.run_eviction()
    assert sorted((call[0], call[2]) for call in disp.calls) == [
        ("node-a", "fs"),
        ("node-b", "nvme"),
        ("node-b", "s3"),
    ]
    disp.calls.clear()
    c.deregister_instance("node-b")  # b's private nvme copy is now unreachable
    c.eviction._inflight.clear()
    report = c.run_eviction()
    assert sorted((call[0], call[2]) for call in disp.calls) == [("node-a", "fs"), ("node-a", "s3")]
    assert report.undeliverable == 0


def test_undeliverable_victims_do_not_block_the_ones_behind() -> None:
    """Kvmesh: the oldest key's only holder is gone; the next key is chosen instead."""
    disp = RecordingDispatcher()
    c = make(ratio=0.5, dispatcher=disp)
    l2(
        c,
        Stream("gone").store([key(1)], tier=Tier.L2),
        Stream("node-a").store([key(2)], tier=Tier.L2),
    )
    c.register_instance("node-a")
    c.set_quota("", 1)
    report = c.run_eviction()
    assert report.plan == {"": (key(2),)}
    assert report.undeliverable == 1
    assert [call[3] for call in disp.calls] == [(key(2),)]


def test_returning_delete_events_clear_the_lru() -> None:
    """The loop converges only through the DELETE events the node reports."""
    disp = RecordingDispatcher()
    c = make(dispatcher=disp)
    c.register_instance("node-a")
    s = Stream()
    l2(c, s.store([key(1), key(2)], tier=Tier.L2, size=10))
    c.set_quota("", 0)
    c.run_eviction()
    (call,) = disp.calls
    l2(c, s.delete(list(call[3]), tier=Tier.L2))
    assert c.plan_eviction() == {}
    assert c.eviction.in_flight_count() == 0


def test_quota_manager_rules() -> None:
    """QuotaManager: negative refused, 0 allowed, unknown limit 0, capture/restore."""
    q = QuotaManager()
    with pytest.raises(InvalidArgument):
        q.set_quota("t", -1)
    with pytest.raises(InvalidArgument):
        q.set_default_limit_bytes(-5)
    q.set_quota("t", 0)
    assert q.list_quotas() == {"t": 0}
    assert q.get_limit_bytes("unknown") == 0
    assert q.effective_limit_bytes("unknown") is None
    assert q.delete_quota("t") is True
    assert q.delete_quota("t") is False
    q.set_quota("u", 9)
    q.set_default_limit_bytes(3)
    other = QuotaManager()
    other.restore(q.capture())
    assert other.list_quotas() == {"u": 9}
    assert other.get_default_limit_bytes() == 3
    assert other.effective_limit_bytes("zzz") == 3
