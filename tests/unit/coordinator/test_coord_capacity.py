"""Capacity declarations and the fleet memory view (docs/coordinator.md, "Capacity")."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.common.errors import InvalidArgument, NotFound
from kvmesh.common.events import IngestResult, Tier, validate_batch
from kvmesh.coordinator.core import Coordinator, CoordinatorSettings, ServerConfigRegistry
from kvmesh.coordinator.core.persistence import find_non_plain
from tests.unit.coordinator.coord_testkit import Stream, key

GIB = 1 << 30


def make() -> Coordinator:
    return Coordinator(CoordinatorSettings(health_check_interval=0, eviction_check_interval=0))


def test_declared_and_used_give_a_ratio() -> None:
    """40 GiB dram, 10 GiB used → 0.25, registered and declared."""
    c = make()
    c.register_instance("node-a")
    s = Stream()
    c.ingest(s.config(Tier.L1, "dram", 40 * GIB, 1))
    c.ingest(s.store([key(1)], size=10 * GIB))
    st = c.instance_usage("node-a")
    assert (st.registered, st.declared_capacity) == (True, True)
    (mod,) = st.modules
    assert (mod.tier, mod.backend, mod.used_bytes, mod.usage_ratio) == (
        Tier.L1,
        "dram",
        10 * GIB,
        0.25,
    )


def test_undeclared_idle_and_overfull_ratios() -> None:
    """Undeclared → None; declared idle → 0.0; 3 GiB of 1 GiB → 3.0 (not clamped)."""
    c = make()
    c.register_instance("a")
    c.ingest(Stream("a").store([key(1)], size=5))
    st = c.instance_usage("a")
    assert st.declared_capacity is False
    assert st.modules[0].usage_ratio is None
    b = Stream("b")
    c.ingest(b.config(Tier.L2, "fs", GIB, 1))
    assert c.instance_usage("b").modules[0].usage_ratio == 0.0
    c.ingest(b.store([key(2)], tier=Tier.L2, size=3 * GIB))
    assert c.instance_usage("b").modules[0].usage_ratio == 3.0


def test_unknown_and_deregistered_instances() -> None:
    """Unknown → NOT_FOUND; L2 bytes keep a gone node listed; L1-only → NOT_FOUND."""
    c = make()
    with pytest.raises(NotFound):
        c.instance_usage("nobody")
    c.register_instance("a")
    a = Stream("a")
    c.ingest(a.config(Tier.L2, "fs", GIB, 1))
    c.ingest(a.store([key(1)], tier=Tier.L2, size=100))
    c.deregister_instance("a")
    st = c.instance_usage("a")
    assert (st.registered, st.declared_capacity) == (False, False)
    assert st.modules[0].used_bytes == 100
    assert st.modules[0].usage_ratio is None
    c.register_instance("b")
    c.ingest(Stream("b").store([key(2)], size=10))
    c.deregister_instance("b")
    with pytest.raises(NotFound):
        c.instance_usage("b")


def test_fleet_view_lists_instances_and_shared_pools_once() -> None:
    """Shared s3 (25 of 100 GiB) once; disagreeing caps → 0/None; empty fleet."""
    assert make().fleet_usage().instances == ()
    assert make().fleet_usage().shared_modules == ()
    c = make()
    a, b = Stream("a"), Stream("b")
    for s in (a, b):
        c.register_instance(s.instance_id)
        c.ingest(s.config(Tier.L1, "dram", 10 * GIB, 1))
        c.ingest(s.config(Tier.L2, "s3", 100 * GIB, 1, shared=True))
    c.ingest(a.store([key(1)], tier=Tier.L2, backend="s3", shared=True, size=25 * GIB))
    c.ingest(b.store([key(1)], tier=Tier.L2, backend="s3", shared=True, size=25 * GIB))
    fleet = c.fleet_usage()
    assert [i.instance_id for i in fleet.instances] == ["a", "b"]
    assert all(m.backend == "dram" for i in fleet.instances for m in i.modules)
    (pool,) = fleet.shared_modules
    assert (pool.backend, pool.used_bytes, pool.usage_ratio) == ("s3", 25 * GIB, 0.25)
    c.ingest(b.config(Tier.L2, "s3", 50 * GIB, 2, shared=True))
    (pool,) = c.fleet_usage().shared_modules
    assert (pool.capacity_bytes, pool.usage_ratio) == (0, None)


def test_registration_declares_nothing_and_config_tier_must_be_concrete() -> None:
    """Repeated compartment within one revision keeps the last value."""
    c = make()
    c.register_instance("a", metadata={"capacity_bytes": "999"})
    assert c.instance_usage("a").declared_capacity is False
    bad = dataclasses.replace(Stream("a").config(Tier.L1, "dram", 1, 1), tier=3)
    with pytest.raises(InvalidArgument, match="tier"):
        validate_batch(bad)
    s = Stream("a")
    c.ingest(s.config(Tier.L1, "dram", 10, 1))
    c.ingest(s.config(Tier.L1, "dram", 20, 1))
    assert [m.capacity_bytes for m in c.capacity.get("a")] == [20]


def test_declaration_stamps_order_by_incarnation_then_revision() -> None:
    reg = ServerConfigRegistry()
    s = Stream("a", incarnation=1)
    reg.consume(s.config(Tier.L1, "dram", 1, 1))
    reg.consume(s.config(Tier.L2, "fs", 2, 2))
    assert [m.backend for m in reg.get("a")] == ["fs"]  # revision 2 replaced revision 1
    reg.consume(s.config(Tier.L1, "dram", 5, 5))
    reg.consume(s.config(Tier.L1, "gds", 3, 3))  # straggler
    assert [m.backend for m in reg.get("a")] == ["dram"]
    reg.consume(s.config(Tier.L2, "fs", 6, 5))  # same revision extends
    assert [m.backend for m in reg.get("a")] == ["dram", "fs"]
    reg.consume(s.config(Tier.L2, "fs", 7, 6))  # new revision omitting dram retires it
    assert [m.backend for m in reg.get("a")] == ["fs"]
    reg.consume(s.config(Tier.L1, "dram", 1, 1, incarnation=2))
    assert reg.stamp("a") == (2, 1)
    c = make()
    c.ingest(Stream("x", incarnation=2).config(Tier.L1, "dram", 1, 1))
    assert c.ingest(Stream("x", incarnation=1).config(Tier.L1, "dram", 9, 9)) is (
        IngestResult.STALE_INCARNATION
    )
    summary = c.ingest_batches(
        [Stream("y").config(Tier.L1, "dram", 4, 1), Stream("y").store([key(1)], seq=2)]
    )
    assert summary.applied == 2


def test_registry_capture_restore_and_straggler_after_restore() -> None:
    """Plain tuples, round trip, stamps restored, non-empty restore refused."""
    reg = ServerConfigRegistry()
    reg.consume(Stream("a", incarnation=3).config(Tier.L1, "dram", 7, 4))
    cap = reg.capture()
    assert cap == {"declarations": [("a", 3, 4, [(int(Tier.L1), "dram", 7, False)])]}
    assert find_non_plain(cap) is None
    fresh = ServerConfigRegistry()
    fresh.restore(cap)
    assert fresh.get_all() == reg.get_all()
    fresh.consume(Stream("a", incarnation=3).config(Tier.L2, "fs", 1, 2))
    assert [m.backend for m in fresh.get("a")] == ["dram"]
    with pytest.raises(ValueError, match="requires an empty registry"):
        fresh.restore(cap)
    assert "server_config" in [comp.name for comp in make().checkpoint_components]
