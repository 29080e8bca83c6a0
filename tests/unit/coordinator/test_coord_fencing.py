"""Lazy fencing of the directory, checked against a naive model of LMCache's semantics.

The directory settles a fence at once (placements invisible, usage and totals
adjusted) and sweeps records later; these tests pin that nothing observable
depends on when the sweep runs (docs/coordinator.md, "Event gate", "Key directory"
and "Usage").
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

from kvmesh.common.events import CacheEventBatch, EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.core import (
    CacheEventBroadcaster,
    CacheUsageManager,
    EventGate,
    KeyDirectory,
    KeySpaces,
)
from kvmesh.coordinator.core.types import Placement
from tests.unit.coordinator.coord_testkit import Stream, key


def lazy(reclaim_per_batch: int = 0) -> KeyDirectory:
    return KeyDirectory(
        KeySpaces(), CacheUsageManager(), fence_sync_keys=0, reclaim_per_batch=reclaim_per_batch
    )


def test_large_fence_is_settled_at_once_and_swept_in_slices() -> None:
    """A fence above the sync threshold: invisible and un-counted now, records swept later."""
    d = lazy()
    a, b = Stream("node-a"), Stream("node-b")
    d.consume(a.store([key(i) for i in range(100)], size=10))
    d.consume(a.store([key(0)], tier=Tier.L2, size=1000))
    d.consume(b.store([key(1)], size=7))
    d.fence_instance("node-a")
    st = d.stats()
    assert (st.l1.count, st.l1.size_bytes) == (1, 7)
    assert st.fence_backlog_keys == 100
    assert st.num_keys == 100  # 98 keys still wait for the sweep
    assert "node-a" not in st.l1_keys_by_instance
    assert d.lookup([key(5)])[0].placements == ()
    assert [p.tier for p in d.lookup([key(0)])[0].placements] == [Tier.L2]
    assert d.usage.get_bytes_by_instance(Tier.L1) == {"node-b": {"dram": 7}}
    assert d.list_keys(limit=1000).entries[0].placements != ()
    assert len(d.list_keys(limit=1000).entries) == 2
    assert d.reclaim_fenced(30) == 70
    assert d.reclaim_fenced(1000) == 0
    st = d.stats()
    assert (st.num_keys, st.fence_backlog_keys) == (2, 0)


def test_batches_drive_the_sweep() -> None:
    """Each consumed batch sweeps a bounded slice of the backlog."""
    d = lazy(reclaim_per_batch=10)
    a = Stream("node-a")
    d.consume(a.store([key(i) for i in range(35)]))
    d.fence_instance("node-a")
    other = Stream("node-b")
    for i in range(4):
        d.consume(other.access([key(i)]))
    assert d.stats().fence_backlog_keys == 0
    assert d.stats().num_keys == 0


def test_restore_by_the_new_incarnation_during_the_sweep_counts_once() -> None:
    """A key re-stored before its fenced record was swept is counted exactly once."""
    d = lazy()
    d.consume(Stream("node-a", incarnation=1).store([key(1), key(2)], size=10))
    d.fence_instance("node-a")
    d.consume(Stream("node-a", incarnation=2).store([key(1)], size=30))
    assert d.usage.get_salt_bytes(Tier.L1, "") == 30
    assert (d.stats().l1.count, d.stats().l1.size_bytes) == (1, 30)
    assert d.lookup([key(1)])[0].placements == (Placement("node-a", 2, Tier.L1, "dram", 30, False),)
    d.reclaim_fenced(100)
    assert d.stats().num_keys == 1
    assert d.usage.get_salt_bytes(Tier.L1, "") == 30


def test_drop_then_same_incarnation_keeps_reporting_visibly() -> None:
    """A heartbeat-timeout drop retires the stream; the node's later batches are live."""
    spaces = KeySpaces()
    d = KeyDirectory(spaces)
    b = CacheEventBroadcaster()
    b.register(d)
    gate = EventGate(b)
    s = Stream("node-a")
    gate.ingest(s.store([key(1)]))
    gate.drop_instance("node-a")
    gate.ingest(s.store([key(2)]))
    assert d.lookup([key(1)])[0].placements == ()
    assert [p.instance_id for p in d.lookup([key(2)])[0].placements] == ["node-a"]
    gate.drop_instance("node-a")
    assert d.lookup([key(2)])[0].placements == ()
    assert d.usage.get_total_bytes(Tier.L1) == 0


def test_delete_of_an_already_fenced_placement_changes_nothing() -> None:
    """Another reporter's delete of a fenced shared L1 placement is not subtracted twice."""
    d = lazy()
    d.consume(Stream("node-a").store([key(1), key(2)], backend="cxl", shared=True, size=5))
    d.fence_instance("node-a")
    d.consume(Stream("node-b").delete([key(1)], backend="cxl", shared=True))
    assert d.usage.get_total_bytes(Tier.L1) == 0
    assert d.stats().l1.count == 0


def test_capture_during_the_sweep_restores_without_fenced_placements() -> None:
    """Records still holding fenced placements are cleaned by restore."""
    d = lazy()
    d.consume(Stream("node-a").store([key(i) for i in range(10)], size=3))
    d.consume(Stream("node-a").store([key(0)], tier=Tier.L2, size=4))
    d.fence_instance("node-a")
    fresh = KeyDirectory(KeySpaces(), CacheUsageManager())
    fresh.restore(d.capture())
    st = fresh.stats()
    assert (st.num_keys, st.l1.count, st.l2.count) == (1, 0, 1)
    assert fresh.usage.get_total_bytes(Tier.L1) == 0
    d.consume(Stream("node-a", incarnation=2).store([key(3)]))
    fresh.consume(Stream("node-a", incarnation=2).store([key(3)]))
    assert fresh.lookup([key(3)]) == d.lookup([key(3)])


# -- differential test against a naive model ----------------------------------


@dataclass
class Model:
    """LMCache's directory semantics, written the obvious way."""

    recs: dict[ObjectKey, list[Placement]] = field(default_factory=dict)

    def apply(self, batch: CacheEventBatch) -> None:
        for entry in batch.entries:
            k = entry.key
            pls = self.recs.get(k, [])

            def same(p: Placement) -> bool:
                return (
                    p.shared == batch.shared
                    and p.tier == batch.tier
                    and p.backend == batch.backend
                    and (batch.shared or p.instance_id == batch.instance_id)
                )

            if batch.event_type == EventType.STORE:
                new = Placement(
                    batch.instance_id,
                    batch.incarnation,
                    batch.tier,
                    batch.backend,
                    entry.size_bytes,
                    batch.shared,
                )
                pls = [p for p in pls if not same(p)] + [new]
                self.recs[k] = pls
            elif batch.event_type == EventType.DELETE and k in self.recs:
                pls = [p for p in pls if not same(p)]
                if pls:
                    self.recs[k] = pls
                else:
                    del self.recs[k]

    def fence(self, iid: str) -> None:
        for k in list(self.recs):
            pls = [p for p in self.recs[k] if not (p.tier == Tier.L1 and p.instance_id == iid)]
            if pls:
                self.recs[k] = pls
            else:
                del self.recs[k]

    def usage(self, tier: Tier) -> tuple[dict[str, int], dict[str, dict[str, int]], int, int]:
        by_salt: dict[str, int] = defaultdict(int)
        by_inst: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        count = size = 0
        for k, pls in self.recs.items():
            for p in pls:
                if p.tier != tier:
                    continue
                count += 1
                size += p.size_bytes
                by_salt[k.cache_salt] += p.size_bytes
                by_inst["" if p.shared else p.instance_id][p.backend] += p.size_bytes
        salts = {s: b for s, b in by_salt.items() if b > 0}
        insts = {
            o: {be: b for be, b in m.items() if b > 0}
            for o, m in by_inst.items()
            if any(b > 0 for b in m.values())
        }
        return salts, insts, count, size


def test_random_operations_match_the_naive_model() -> None:
    """Stores, deletes, accesses, restarts and drops in random order, swept lazily."""
    rng = random.Random(20240611)
    keys = [key(i, salt=rng.choice(["", "t1", "t2"])) for i in range(40)]
    instances = ["node-a", "node-b", "node-c"]
    incarnation = dict.fromkeys(instances, 1)
    seq = dict.fromkeys(instances, 0)
    compartments = [
        (Tier.L1, "dram", False),
        (Tier.L1, "cxl", True),
        (Tier.L2, "fs", False),
        (Tier.L2, "s3", True),
    ]
    d = KeyDirectory(KeySpaces(), fence_sync_keys=rng.choice([0, 5]), reclaim_per_batch=3)
    b = CacheEventBroadcaster()
    b.register(d)
    gate = EventGate(b)
    model = Model()
    for step in range(1500):
        iid = rng.choice(instances)
        roll = rng.random()
        if roll < 0.05:
            incarnation[iid] += 1
            seq[iid] = 0
            model.fence(iid)  # the gate fences before the new incarnation's batch
        elif roll < 0.08:
            gate.drop_instance(iid)
            model.fence(iid)
            seq[iid] = 0
            continue
        tier, backend, shared = rng.choice(compartments)
        chosen = rng.sample(keys, rng.randint(1, 6))
        s = Stream(iid, incarnation[iid], seq[iid])
        op = rng.random()
        if op < 0.55:
            batch = s.store(
                chosen, tier=tier, backend=backend, shared=shared, size=rng.randint(0, 50)
            )
        elif op < 0.85:
            batch = s.delete(chosen, tier=tier, backend=backend, shared=shared)
        else:
            batch = s.access(chosen, tier=tier, ts=float(step))
        seq[iid] = s.seq
        gate.ingest(batch)
        model.apply(batch)
        if step % 25 == 0 or step > 1490:
            for k in keys:
                expect = tuple(
                    sorted(model.recs.get(k, []), key=lambda p: (p.instance_id, p.tier, p.backend))
                )
                assert d.lookup([k])[0].placements == expect, (step, k)
            st = d.stats()
            for tier_ in (Tier.L1, Tier.L2):
                salts, insts, count, size = model.usage(tier_)
                assert d.usage.get_bytes_by_salt(tier_) == salts, step
                assert d.usage.get_bytes_by_instance(tier_) == insts, step
                totals = st.l1 if tier_ == Tier.L1 else st.l2
                assert (totals.count, totals.size_bytes) == (count, size), step
            if step % 100 == 0:
                fresh = KeyDirectory(KeySpaces())
                fresh.restore(d.capture())
                assert fresh.lookup(keys) == d.lookup(keys), step
    d.reclaim_fenced(10_000)
    assert d.stats().num_keys == len(model.recs)
    assert d.stats().fence_backlog_keys == 0
