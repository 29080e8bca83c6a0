"""Eviction: byte watermarks, LRU order, per-salt quotas on L1 and L2, locks and pins respected."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.controllers.l2tier import L2Tier
from kvmesh.storage.core.eviction import (
    EvictionController,
    L2EvictionConfig,
    Quota,
    QuotaManager,
)
from kvmesh.storage.core.l1.manager import L1Manager
from kvmesh.storage.core.l1.pool import L1Pool
from kvmesh.storage.core.l1.results import L1Result, RemovalReason
from kvmesh.storage.core.lru import ByteLRU
from kvmesh.storage.core.pins import PinTable
from tests.unit.storage.helpers import MIB, FakeClock, FakeL2, RecordingSink, make_key

S = L1Result.SUCCESS


class EvictionSignal:
    """L1 listener that sets an event when keys are evicted."""

    def __init__(self) -> None:
        self.evicted: list[ObjectKey] = []
        self.event = threading.Event()

    def on_admitted(self, keys: Sequence[ObjectKey], sizes: Sequence[int], from_l2: bool) -> None:
        pass

    def on_removed(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], reason: RemovalReason
    ) -> None:
        if reason is RemovalReason.EVICTED:
            self.evicted.extend(keys)
            self.event.set()

    def on_touched(self, keys: Sequence[ObjectKey]) -> None:
        pass


def build(
    make_pool: Callable[..., L1Pool],
    clock: FakeClock,
    *,
    capacity: int = 16 * MIB,
    default: Quota | None = None,
    tiers: Sequence[L2Tier] = (),
    pins: PinTable | None = None,
    **kwargs: object,
) -> tuple[L1Manager, EvictionController]:
    pool = make_pool(capacity, initial_bytes=capacity)
    l1 = L1Manager(pool, clock=clock)
    ev = EvictionController(
        l1,
        pool,
        QuotaManager(default),
        pins or PinTable(),
        tiers=tiers,
        **kwargs,  # type: ignore[arg-type]
    )
    l1.add_listener(ev.policy)
    l1.set_reclaim(ev.reclaim)
    return l1, ev


def store(l1: L1Manager, keys: Sequence[ObjectKey], size: int = MIB) -> None:
    results, _ = l1.reserve_write(keys, [size] * len(keys))
    assert results == [S] * len(keys)
    assert l1.finish_write(keys) == [S] * len(keys)


KEYS = [make_key(i) for i in range(32)]


# -- ByteLRU and quotas ------------------------------------------------------------------


def test_byte_lru_orders_by_recency_and_counts_bytes_per_salt() -> None:
    lru = ByteLRU()
    a, b, c = make_key(1, salt="x"), make_key(2), make_key(3, salt="x")
    lru.add([a, b, c], [10, 20, 30])
    lru.touch([a])
    assert [k for k, _ in lru.oldest(1000)] == [b, c, a]
    assert [k for k, _ in lru.oldest(25)] == [b, c]
    assert [k for k, _ in lru.oldest(1000, salt="x")] == [c, a]
    assert [k for k, _ in lru.oldest(1000, skip=[b])] == [c, a]
    assert lru.bytes_by_salt() == {"x": 40, "": 20}
    assert lru.remove([a, make_key(9)]) == 10
    assert lru.total_bytes == 50
    lru.add([c], [5])  # re-adding replaces the size
    assert lru.salt_bytes("x") == 5


def test_quota_manager_validates_and_unset_salts_are_exempt_by_default() -> None:
    quotas = QuotaManager()
    assert quotas.effective("t") is None
    quotas.set_quota("t", Quota(l1_bytes=5))
    assert quotas.get_quota("t") == Quota(l1_bytes=5)
    with pytest.raises(InvalidArgument):
        quotas.set_quota("t", Quota(l2_bytes=-1))
    with pytest.raises(InvalidArgument):
        quotas.set_quota("bad/salt", Quota(l1_bytes=1))
    assert quotas.delete_quota("t")
    assert not quotas.delete_quota("t")
    with_default = QuotaManager(default=Quota(l1_bytes=7))
    assert with_default.effective("anyone") == Quota(l1_bytes=7)
    assert with_default.get_quota("anyone") is None


# -- L1 ----------------------------------------------------------------------------------


def test_l1_evicts_least_recently_used_bytes_down_to_the_target(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, ev = build(make_pool, clock)
    store(l1, KEYS[:13])  # 13 of 16 MiB: above the 0.8 trigger
    l1.touch([KEYS[0]])
    assert ev.evict_l1_once() == 2  # down to <= 0.7 * 16 MiB = 11.2 MiB
    assert l1.contains(KEYS[:3]) == [True, False, False]
    assert l1.pool.used_bytes == 11 * MIB


def test_l1_watermark_counts_bytes_not_objects(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, ev = build(make_pool, clock)
    big = make_key(100)
    store(l1, [big], size=4 * MIB)
    store(l1, KEYS[:9])  # 13 MiB in 10 objects
    # LMCache would evict 20 % of the objects (two); freeing 1.8 MiB needs only the big one.
    assert ev.evict_l1_once() == 1
    assert l1.contains([big]) == [False]
    assert l1.resident_count == 9


def test_l1_below_the_trigger_evicts_nothing(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, ev = build(make_pool, clock)
    store(l1, KEYS[:12])  # 75 %
    assert ev.evict_l1_once() == 0
    assert l1.resident_count == 12


def test_read_locked_and_staging_objects_are_never_evicted(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, ev = build(make_pool, clock)
    store(l1, KEYS[:12])
    l1.reserve_read([KEYS[0], KEYS[1]])
    assert l1.reserve_write([KEYS[20]], [MIB])[0] == [S]  # staging: 13 MiB used
    assert ev.evict_l1_once() == 2
    assert l1.contains(KEYS[:4]) == [True, True, False, False]
    assert l1.staging_count == 1


def test_a_salt_over_its_l1_quota_loses_only_its_own_keys(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, ev = build(make_pool, clock)
    b_old = make_key(50, salt="b")
    store(l1, [b_old])  # the oldest key of all
    a_keys = [make_key(i, salt="a") for i in range(4)]
    store(l1, a_keys)
    store(l1, KEYS[:3])  # default salt, no quota: exempt
    ev.quotas.set_quota("a", Quota(l1_bytes=2 * MIB))
    assert ev.evict_l1_once() == 2
    assert l1.contains(a_keys) == [False, False, True, True]
    assert l1.contains([b_old, *KEYS[:3]]) == [True] * 4
    assert l1.bytes_by_salt()["a"] == 2 * MIB
    assert ev.l1_quota_evicted_keys == 2


def test_an_explicit_default_quota_applies_to_salts_without_one(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, ev = build(make_pool, clock, default=Quota(l1_bytes=MIB))
    c_keys = [make_key(i, salt="c") for i in range(3)]
    d_keys = [make_key(i, salt="d") for i in range(3)]
    store(l1, c_keys + d_keys)
    ev.quotas.set_quota("d", Quota(l1_bytes=None, l2_bytes=0))  # own quota: no L1 limit
    ev.evict_l1_once()
    assert l1.contains(c_keys) == [False, False, True]
    assert l1.contains(d_keys) == [True] * 3


def test_a_store_is_not_refused_while_evictable_memory_exists(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, ev = build(make_pool, clock, capacity=8 * MIB)
    store(l1, KEYS[:8])  # full
    results, objs = l1.reserve_write([KEYS[10]], [2 * MIB])
    assert results == [S]
    assert KEYS[10] in objs
    assert l1.contains(KEYS[:3]) == [False, False, True]
    assert ev.reclaims == 1


def test_reclaim_evicts_until_a_contiguous_hole_fits(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, _ = build(make_pool, clock, capacity=4 * MIB)
    store(l1, KEYS[:4])  # one 4 MiB segment of four 1 MiB objects
    l1.touch([KEYS[0], KEYS[2]])  # LRU order: 1, 3, 0, 2
    # 2 MiB needs two *adjacent* objects gone, not just any 2 MiB.
    assert l1.reserve_write([KEYS[10]], [2 * MIB])[0] == [S]
    # 1 and 3 go first (oldest) but leave two separate holes; 0 then joins one of them.
    assert l1.contains(KEYS[:4]) == [False, False, True, False]
    assert l1.pool.used_bytes == 3 * MIB


def test_allocation_fails_when_everything_is_locked(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, ev = build(make_pool, clock, capacity=4 * MIB)
    store(l1, KEYS[:4])
    l1.reserve_read(KEYS[:4])
    assert l1.reserve_write([KEYS[10]], [MIB])[0] == [L1Result.OUT_OF_MEMORY]
    assert l1.resident_count == 4
    assert ev.reclaim_failures == 1


def test_the_eviction_loop_survives_an_error(
    make_pool: Callable[..., L1Pool], clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    l1, ev = build(make_pool, clock, period_s=0.01)
    second_cycle = threading.Event()
    calls = 0
    real_reap = l1.reap

    def flaky_reap() -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom (test)")
        second_cycle.set()
        return real_reap()

    monkeypatch.setattr(l1, "reap", flaky_reap)
    ev.start()
    try:
        assert second_cycle.wait(10)
    finally:
        ev.close()
    assert ev.loop_errors == 1


def test_an_admission_above_the_watermark_wakes_the_loop(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1, ev = build(make_pool, clock, period_s=3600.0)
    signal = EvictionSignal()
    l1.add_listener(signal)
    ev.start()
    try:
        store(l1, KEYS[:12])
        assert not signal.event.is_set()
        store(l1, [KEYS[12]])
        assert signal.event.wait(10)
    finally:
        ev.close()
    assert signal.evicted[0] == KEYS[0]


def test_a_new_quota_wakes_the_loop(make_pool: Callable[..., L1Pool], clock: FakeClock) -> None:
    l1, ev = build(make_pool, clock, period_s=3600.0)
    signal = EvictionSignal()
    l1.add_listener(signal)
    keys = [make_key(i, salt="q") for i in range(3)]
    store(l1, keys)
    ev.start()
    try:
        ev.quotas.set_quota("q", Quota(l1_bytes=0))
        assert signal.event.wait(10)
    finally:
        ev.close()
    assert set(signal.evicted) <= set(keys)


# -- L2 ----------------------------------------------------------------------------------


def make_tier(
    clock: FakeClock, sink: RecordingSink | None = None, **kwargs: object
) -> tuple[FakeL2, L2Tier]:
    adapter = FakeL2(**kwargs)  # type: ignore[arg-type]
    tier = L2Tier(adapter, sink=sink, clock=clock)
    tier.refresh_capacity()
    return adapter, tier


def put(tier: L2Tier, keys: Sequence[ObjectKey], size: int = MIB) -> None:
    payload = memoryview(bytearray(size))
    assert tier.put_many([(k, payload) for k in keys]) == [True] * len(keys)


def test_l2_eviction_deletes_oldest_bytes_above_the_watermark(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    sink = RecordingSink()
    adapter, tier = make_tier(clock, sink, capacity_bytes=10 * MIB)
    put(tier, KEYS[:9])
    tier.index.touch([KEYS[0]])
    _, ev = build(make_pool, clock, tiers=[tier])
    assert ev.evict_l2_once() == 2
    assert adapter.deleted == [KEYS[1], KEYS[2]]
    assert tier.index.total_bytes == 7 * MIB
    assert sink.keys_of(EventType.DELETE, Tier.L2) == [KEYS[1], KEYS[2]]


def test_l2_keys_pinned_by_a_prefetch_are_not_deleted(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    adapter, tier = make_tier(clock, capacity_bytes=10 * MIB)
    put(tier, KEYS[:9])
    pins = PinTable()
    assert pins.pin(tier.name, [KEYS[0]]) == [True]
    _, ev = build(make_pool, clock, tiers=[tier], pins=pins)
    ev.evict_l2_once()
    assert KEYS[0] not in adapter.deleted
    assert adapter.deleted == [KEYS[1], KEYS[2]]


def test_a_key_being_deleted_cannot_be_pinned() -> None:
    pins = PinTable()
    k = make_key(1)
    assert pins.claim_for_delete("t", [k]) == [k]
    assert pins.pin("t", [k]) == [False]
    pins.release_delete("t", [k])
    assert pins.pin("t", [k]) == [True]
    assert pins.claim_for_delete("t", [k]) == []


def test_a_salt_over_its_l2_quota_loses_only_its_own_keys(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    adapter, tier = make_tier(clock)  # no declared capacity: quotas only
    other = make_key(99, salt="o")
    put(tier, [other])
    s_keys = [make_key(i, salt="s") for i in range(4)]
    put(tier, s_keys)
    _, ev = build(make_pool, clock, tiers=[tier])
    ev.quotas.set_quota("s", Quota(l2_bytes=MIB))
    assert ev.evict_l2_once() == 3
    assert adapter.deleted == s_keys[:3]
    assert other in adapter.objects


def test_shared_adapters_are_left_to_the_coordinator_unless_configured(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    _, tier = make_tier(clock, shared=True, capacity_bytes=10 * MIB)
    put(tier, KEYS[:9])
    _, ev = build(make_pool, clock, tiers=[tier])
    assert ev.evict_l2_once() == 0
    _, ev2 = build(make_pool, clock, tiers=[tier], l2_configs={tier.name: L2EvictionConfig()})
    assert ev2.evict_l2_once() == 2


def test_l2_eviction_of_a_down_adapter_degrades_it_without_raising(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    adapter, tier = make_tier(clock, capacity_bytes=10 * MIB)
    put(tier, KEYS[:9])
    adapter.down = True
    _, ev = build(make_pool, clock, tiers=[tier])
    assert ev.evict_l2_once() == 0
    assert tier.degraded
    assert len(tier.index) == 9
