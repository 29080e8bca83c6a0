"""Instance registry and heartbeat expiry (docs/coordinator.md, "Membership")."""

from __future__ import annotations

import pytest

from kvmesh.common.errors import NotFound
from kvmesh.common.events import Tier
from kvmesh.coordinator.core import (
    Coordinator,
    CoordinatorSettings,
    InstanceRegistry,
    evict_stale,
)
from kvmesh.coordinator.core.types import Endpoints
from tests.support.waiting import wait_until
from tests.unit.coordinator.coord_testkit import FakeClock, Stream, key


def make(clock: FakeClock, **kw: float) -> Coordinator:
    settings = CoordinatorSettings(
        instance_timeout=kw.get("instance_timeout", 30.0),
        health_check_interval=kw.get("health_check_interval", 0.0),
        eviction_check_interval=0,
    )
    return Coordinator(settings, clock=clock)


def test_register_reports_whether_it_was_a_reregistration() -> None:
    c = make(FakeClock())
    ends = Endpoints(gateway_address="10.0.0.7:8765", storage_address="10.0.0.7:8766")
    first = c.register_instance("i1", incarnation=3, endpoints=ends, metadata={"zone": "a"})
    again = c.register_instance("i1", incarnation=4, endpoints=ends)
    assert (first.instance_id, first.re_registered) == ("i1", False)
    assert (again.instance_id, again.re_registered) == ("i1", True)
    (info,) = c.list_instances()
    assert (info.incarnation, info.endpoints, dict(info.metadata)) == (4, ends, {})


def test_heartbeat_known_ok_unknown_not_found() -> None:
    """An unknown id answers NOT_FOUND, meaning "register again"."""
    c = make(FakeClock())
    c.register_instance("i1")
    c.heartbeat("i1")
    with pytest.raises(NotFound, match="re-register") as info:
        c.heartbeat("ghost")
    assert info.value.reason == "INSTANCE_NOT_REGISTERED"


def test_deregistering_a_never_registered_id_is_fine() -> None:
    c = make(FakeClock())
    assert c.deregister_instance("ghost") is False


def test_empty_instance_id_is_replaced_by_a_generated_one() -> None:
    c = make(FakeClock())
    reg = c.register_instance("   ")
    assert reg.instance_id.startswith("kvm-")
    assert [i.instance_id for i in c.list_instances()] == [reg.instance_id]


def test_registry_snapshots_heartbeats_and_monotonic_staleness() -> None:
    """Snapshots are independent; heartbeats update; stale uses the monotonic clock."""
    clock = FakeClock()
    wall = FakeClock(1.7e9)
    reg = InstanceRegistry(clock=clock, wall_clock=wall)
    reg.register("a", metadata={"zone": "x"})
    snap = reg.all_instances()
    reg.register("b")
    assert [i.instance_id for i in snap] == ["a"]
    assert snap[0].metadata == {"zone": "x"}
    assert snap[0].registration_time == 1.7e9
    clock.advance(10)
    assert reg.all_instances()[0].heartbeat_age_seconds == 10
    assert reg.update_heartbeat("a") is True
    assert reg.update_heartbeat("zzz") is False
    wall.advance(-1e9)  # the wall clock jumping back changes nothing
    clock.advance(25)
    assert reg.stale(30) == ["b"]
    clock.advance(5)
    assert reg.stale(30) == ["b"]  # exactly 30 s is not "more than"
    clock.advance(0.001)
    assert sorted(reg.stale(30)) == ["a", "b"]
    assert reg.get("a") is not None
    assert reg.random_instance() is not None


def test_evict_stale_removes_only_expired_instances() -> None:
    clock = FakeClock()
    reg = InstanceRegistry(clock=clock)
    reg.register("old")
    clock.advance(20)
    reg.register("new")
    clock.advance(15)
    assert evict_stale(reg, 30) == ["old"]
    assert [i.instance_id for i in reg.all_instances()] == ["new"]


def test_reaped_instance_loses_l1_usage_and_keeps_l2() -> None:
    """Heartbeat expiry fences L1 (and forgets the cursor) but keeps L2."""
    clock = FakeClock()
    c = make(clock)
    c.register_instance("node-a")
    s = Stream()
    c.ingest(s.store([key(1)], size=100))
    c.ingest(s.store([key(2)], tier=Tier.L2, size=200))
    clock.advance(31)
    assert c.sweep_stale_instances() == ["node-a"]
    assert c.list_quota_status(Tier.L1).total_bytes == 0
    assert c.list_quota_status(Tier.L2).total_bytes == 200
    assert "node-a" not in c.cursors()


def test_reaped_instance_loses_its_capacity_declaration() -> None:
    """After a timeout the instance's usage view is NOT_FOUND."""
    clock = FakeClock()
    c = make(clock)
    c.register_instance("node-a")
    c.ingest(Stream().config(Tier.L1, "dram", 1 << 30, 1))
    assert c.instance_usage("node-a").declared_capacity is True
    clock.advance(31)
    c.sweep_stale_instances()
    with pytest.raises(NotFound):
        c.instance_usage("node-a")
    assert c.capacity.get("node-a") == ()


def test_registration_touches_neither_cursor_nor_capacity() -> None:
    """Re-registering keeps the gate cursor and the declaration."""
    c = make(FakeClock())
    c.ingest(Stream().config(Tier.L1, "dram", 100, 1))
    c.register_instance("node-a")
    c.register_instance("node-a")
    assert c.cursors()["node-a"].last_seq == 1
    assert c.capacity.get("node-a")[0].capacity_bytes == 100


def test_deregister_fences_and_forgets_even_unknown_ids() -> None:
    """DELETE always drops the gate cursor and the capacity declaration."""
    c = make(FakeClock())
    s = Stream()
    c.ingest(s.config(Tier.L1, "dram", 100, 1))
    c.ingest(s.store([key(1)]))
    assert c.deregister_instance("node-a") is False  # never registered
    assert c.cursors() == {}
    assert c.capacity.get("node-a") == ()
    assert c.stats().num_keys == 0


def test_health_timer_reaps_a_silent_instance() -> None:
    """On the core: a short timeout and sweep interval reap a node that never beats."""
    c = Coordinator(
        CoordinatorSettings(
            instance_timeout=0.05, health_check_interval=0.02, eviction_check_interval=0
        )
    )
    c.start()
    try:
        c.register_instance("quiet")
        assert wait_until(lambda: c.list_instances() == [])
    finally:
        c.stop()
    assert all(not t.running for t in c.timers)
