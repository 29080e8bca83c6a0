"""Usage view fed by the directory (docs/coordinator.md, "Usage")."""

from __future__ import annotations

from kvmesh.common.events import CacheEventBatch, Tier
from kvmesh.coordinator.core import CacheUsageManager, KeyDirectory, KeySpaces
from tests.unit.coordinator.coord_testkit import Stream, key


def make() -> tuple[KeyDirectory, CacheUsageManager]:
    usage = CacheUsageManager()
    return KeyDirectory(KeySpaces(), usage), usage


def apply(d: KeyDirectory, *batches: CacheEventBatch) -> None:
    for b in batches:
        d.consume(b)


def test_bytes_aggregate_per_salt_access_ignored_restore_applies_delta() -> None:
    """Per-salt sums; ACCESS changes nothing; 100 then 250 gives 250."""
    d, u = make()
    s = Stream()
    apply(
        d,
        s.store([key(1, salt="t1"), key(2, salt="t1")], tier=Tier.L2, size=100),
        s.store([key(3, salt="t2")], tier=Tier.L2, size=40),
        s.access([key(1, salt="t1")], tier=Tier.L2, backend="fs"),
    )
    assert u.get_bytes_by_salt(Tier.L2) == {"t1": 200, "t2": 40}
    apply(d, s.store([key(3, salt="t2")], tier=Tier.L2, size=250))
    assert u.get_salt_bytes(Tier.L2, "t2") == 250
    assert u.get_total_bytes(Tier.L2) == 450


def test_delete_subtracts_and_cleans_up_and_untracked_delete_is_noop() -> None:
    """The recorded size is subtracted (the wire size on a delete is ignored)."""
    d, u = make()
    s = Stream()
    apply(d, s.store([key(1, salt="t")], tier=Tier.L2, size=100))
    apply(d, s.delete([key(9, salt="t")], tier=Tier.L2))
    assert u.get_salt_bytes(Tier.L2, "t") == 100
    apply(d, s.delete([key(1, salt="t")], tier=Tier.L2))
    assert u.get_bytes_by_salt(Tier.L2) == {}
    assert u.get_bytes_by_instance(Tier.L2) == {}
    assert u.is_empty()


def test_private_copies_count_twice_shared_pool_once() -> None:
    """2 private + 1 shared (2 reporters) = 300; any reporter's delete clears it."""
    d, u = make()
    a, b = Stream("node-a"), Stream("node-b")
    apply(
        d,
        a.store([key(1)], tier=Tier.L2, size=100),
        b.store([key(1)], tier=Tier.L2, size=100),
        a.store([key(1)], tier=Tier.L2, backend="s3", shared=True, size=100),
        b.store([key(1)], tier=Tier.L2, backend="s3", shared=True, size=100),
    )
    assert u.get_salt_bytes(Tier.L2, "") == 300
    apply(d, a.delete([key(1)], tier=Tier.L2, backend="s3", shared=True))
    assert u.get_salt_bytes(Tier.L2, "") == 200
    assert "" not in u.get_bytes_by_instance(Tier.L2)


def test_key_bytes_sum_over_backends() -> None:
    d, _u = make()
    s = Stream()
    apply(
        d,
        s.store([key(1)], tier=Tier.L2, backend="fs", size=10),
        s.store([key(1)], tier=Tier.L2, backend="s3", size=20),
    )
    assert d.key_bytes(Tier.L2, key(1)) == 30


def test_tiers_are_accounted_separately() -> None:
    """L2 100 and L1 40 for one key; an L1 delete leaves L2."""
    d, u = make()
    s = Stream()
    apply(d, s.store([key(1)], tier=Tier.L2, size=100), s.store([key(1)], size=40))
    assert (u.get_salt_bytes(Tier.L2, ""), u.get_salt_bytes(Tier.L1, "")) == (100, 40)
    apply(d, s.delete([key(1)]))
    assert (u.get_salt_bytes(Tier.L2, ""), u.get_salt_bytes(Tier.L1, "")) == (100, 0)


def test_bytes_by_instance_lists_backends_and_shared_owner() -> None:
    """Per owner and backend; shared under ""; emptied backends disappear."""
    d, u = make()
    a, b = Stream("node-a"), Stream("node-b")
    apply(
        d,
        a.store([key(1)], size=100),
        a.store([key(2)], backend="gds", size=30),
        b.store([key(3)], size=70),
        b.store([key(4)], backend="cxl", shared=True, size=5),
    )
    assert u.get_bytes_by_instance(Tier.L1) == {
        "node-a": {"dram": 100, "gds": 30},
        "node-b": {"dram": 70},
        "": {"cxl": 5},
    }
    apply(d, a.delete([key(2)], backend="gds"))
    assert u.get_bytes_by_instance(Tier.L1)["node-a"] == {"dram": 100}


def test_fence_drops_only_that_instances_l1_and_is_idempotent() -> None:
    """Keeps its L2, spares shared L2, idempotent, no double count on re-store."""
    d, u = make()
    a, b = Stream("node-a"), Stream("node-b")
    apply(
        d,
        a.store([key(1)], size=100),
        a.store([key(1)], tier=Tier.L2, size=1000),
        a.store([key(2)], tier=Tier.L2, backend="s3", shared=True, size=7),
        b.store([key(3)], size=50),
    )
    d.fence_instance("node-a")
    d.fence_instance("node-a")
    assert u.get_bytes_by_instance(Tier.L1) == {"node-b": {"dram": 50}}
    assert u.get_salt_bytes(Tier.L2, "") == 1007
    apply(d, Stream("node-a", incarnation=2).store([key(1)], size=100))
    assert u.get_salt_bytes(Tier.L1, "") == 150


def test_shared_l1_fence_is_consistent_between_directory_and_usage() -> None:
    """Fixed: a shared L1 placement fenced in the directory is un-counted in usage.

    LMCache's usage view kept its bytes (owner "") while the directory dropped
    it; kvmesh derives usage from the directory, so both agree.
    """
    d, u = make()
    ctl, b = Stream("pool-ctl"), Stream("node-b")
    apply(
        d,
        ctl.store([key(1)], backend="cxl", shared=True, size=64),
        ctl.store([key(2)], backend="cxl", shared=True, size=64),
        b.store([key(2)], backend="cxl", shared=True, size=64),
    )
    assert u.get_bytes_by_instance(Tier.L1) == {"": {"cxl": 128}}
    d.fence_instance("pool-ctl")
    assert d.lookup([key(1)])[0].placements == ()
    assert u.get_bytes_by_instance(Tier.L1) == {"": {"cxl": 64}}
    assert u.get_total_bytes(Tier.L1) == d.stats().l1.size_bytes == 64
