"""The StorageManager facade: start-up index, deletes per tier, quotas, status, capacity, close."""

from __future__ import annotations

import os
import threading

import pytest

from kvmesh.common.errors import FailedPrecondition, InvalidArgument
from kvmesh.common.events import EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.eviction import Quota
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.l1_events import L1_BACKEND
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.options import StorageOptions
from tests.unit.storage.helpers import MIB, FakeClock, FakeL2, RecordingSink, make_key

CHUNK = 64 * 1024
KEYS = [make_key(i) for i in range(8)]


def options(shm_dir: str, **kwargs: object) -> StorageOptions:
    kwargs.setdefault("background_threads", False)
    return StorageOptions(segment_bytes=4 * MIB, shm_dir=shm_dir, **kwargs)  # type: ignore[arg-type]


def write(m: StorageManager, keys: list[ObjectKey], size: int = CHUNK) -> None:
    objs = m.reserve_write(keys, size)
    assert set(objs) == set(keys)
    assert m.finish_write(keys) == [L1Result.SUCCESS] * len(keys)
    assert m.flush_l2_writes(10)


def test_start_up_indexes_each_adapter_and_announces_its_placements(
    shm_dir: str, clock: FakeClock
) -> None:
    adapter = FakeL2(backend="disk", capacity_bytes=64 * MIB)
    for key in KEYS[:3]:
        adapter.put_bytes(key, b"x" * CHUNK)
    adapter.put_bytes(make_key(9, salt="t"), b"y" * 100)
    sink = RecordingSink()
    with StorageManager(
        "n1", 8 * MIB, l2_adapters=[adapter], event_sink=sink, options=options(shm_dir), clock=clock
    ) as m:
        assert m.wait_l2_index(10)
        report = m.index_report()["disk"]
        assert report["state"] == "complete"
        assert report["objects"] == 4
        assert report["bytes"] == 3 * CHUNK + 100
        assert report["bytes_by_salt"] == {"": 3 * CHUNK, "t": 100}
        stores = [e for e in sink.events if e[0] is EventType.STORE and e[1] is Tier.L2]
        assert {k for e in stores for k, _ in e[4]} == {*KEYS[:3], make_key(9, salt="t")}
        assert all(e[2] == "disk" and e[3] is False for e in stores)
        # Capacity is declared for L1 and, once known, for L2.
        assert (Tier.L1, L1_BACKEND, 8 * MIB, False) in sink.capacities[-1]
        assert (Tier.L2, "disk", 64 * MIB, False) in sink.capacities[-1]


def test_an_adapter_down_at_start_leaves_the_node_serving_l1(
    shm_dir: str, clock: FakeClock
) -> None:
    adapter = FakeL2()
    adapter.down = True
    with StorageManager(
        "n1", 8 * MIB, l2_adapters=[adapter], options=options(shm_dir), clock=clock
    ) as m:
        assert m.wait_l2_index(10)
        assert m.index_report()["fake"]["state"] in {"pending", "failed"}
        assert m.status()["l2"][0]["degraded"]
        write(m, KEYS[:2])
        assert m.l1.contains(KEYS[:2]) == [True, True]


def test_an_adapter_that_comes_back_is_indexed_and_announced_then(
    shm_dir: str, clock: FakeClock
) -> None:
    adapter = FakeL2()
    adapter.put_bytes(KEYS[0], b"x" * CHUNK)
    adapter.down = True
    sink = RecordingSink()
    with StorageManager(
        "n1",
        8 * MIB,
        l2_adapters=[adapter],
        event_sink=sink,
        options=options(shm_dir, l2_backoff_s=0.01),
        clock=clock,
    ) as m:
        assert m.wait_l2_index(10)
        assert sink.keys_of(EventType.STORE, Tier.L2) == []
        adapter.down = False
        clock.advance(1.0)  # past the adapter's backoff
        assert sink.wait_for_keys(EventType.STORE, Tier.L2, 1)
        assert m.index_report()["fake"]["objects"] == 1
        assert m.status()["l2"][0]["healthy"]


def test_delete_by_tier_counts_deleted_and_skipped(shm_dir: str, clock: FakeClock) -> None:
    adapter = FakeL2()
    with StorageManager(
        "n1", 8 * MIB, l2_adapters=[adapter], options=options(shm_dir), clock=clock
    ) as m:
        write(m, KEYS[:4])
        m.reserve_read([KEYS[0]])
        assert m.delete([KEYS[0], KEYS[1]], Tier.L1) == (1, 1)
        assert m.l1.contains(KEYS[:2]) == [True, False]
        assert m.delete([KEYS[1], KEYS[2]], Tier.L2) == (2, 0)
        assert set(adapter.objects) == {KEYS[0], KEYS[3]}
        assert m.delete([KEYS[3]]) == (2, 0)  # both tiers
        assert m.delete([KEYS[0]], force=True) == (2, 0)
        assert m.status()["l1"]["resident_objects"] == 1  # KEYS[2]


def test_quotas_are_managed_through_the_facade(shm_dir: str, clock: FakeClock) -> None:
    with StorageManager("n1", 8 * MIB, options=options(shm_dir), clock=clock) as m:
        assert m.set_quota("t1", l1_bytes=MIB) == Quota(l1_bytes=MIB)
        m.set_quota("t2", l2_bytes=0)
        assert m.get_quota("t1") == Quota(l1_bytes=MIB)
        assert m.get_quota("nobody") is None
        assert m.list_quotas() == {"t1": Quota(l1_bytes=MIB), "t2": Quota(l2_bytes=0)}
        assert m.delete_quota("t2")
        with pytest.raises(InvalidArgument):
            m.set_quota("t1", l1_bytes=-5)
        status = m.status()
        assert status["quotas"] == {"t1": {"l1_bytes": MIB, "l2_bytes": None}}
        assert status["default_quota"] is None
        # The quota is enforced on the next eviction cycle.
        keys = [make_key(i, salt="t1") for i in range(4)]
        write(m, keys, size=MIB // 2)
        m.run_eviction_once()
        assert m.l1.bytes_by_salt()["t1"] == MIB


def test_status_reports_l1_l2_controllers_and_per_salt_bytes(
    shm_dir: str, clock: FakeClock
) -> None:
    with StorageManager(
        "n1", 8 * MIB, l2_adapters=[FakeL2()], options=options(shm_dir), clock=clock
    ) as m:
        write(m, [KEYS[0], make_key(1, salt="s")])
        m.reserve_write([KEYS[5]], CHUNK)
        status = m.status()
        l1 = status["l1"]
        assert l1["capacity_bytes"] == 8 * MIB
        assert l1["committed_bytes"] == 4 * MIB
        assert l1["used_bytes"] == 3 * CHUNK
        assert l1["resident_objects"] == 2
        assert l1["staging_objects"] == 1
        assert l1["bytes_by_salt"] == {"": CHUNK, "s": CHUNK}
        assert 0 < l1["usage_ratio"] < 1
        assert status["l2"][0]["healthy"]
        assert status["l2"][0]["index_objects"] == 2
        assert status["store"]["pending_keys"] == 0
        assert status["prefetch"]["in_flight"] == 0
        assert "l1_evicted_keys" in status["eviction"]


def test_reserve_write_validates_sizes_and_refuses_after_close(
    shm_dir: str, clock: FakeClock
) -> None:
    m = StorageManager("n1", 8 * MIB, options=options(shm_dir), clock=clock)
    with pytest.raises(InvalidArgument):
        m.reserve_write(KEYS[:2], [CHUNK])
    with pytest.raises(InvalidArgument):
        m.reserve_write(KEYS[:1], 5 * MIB)  # larger than a segment
    m.close()
    with pytest.raises(FailedPrecondition):
        m.reserve_write(KEYS[:1], CHUNK)


def test_a_full_pool_grows_before_it_evicts(shm_dir: str, clock: FakeClock) -> None:
    with StorageManager("n1", 8 * MIB, options=options(shm_dir), clock=clock) as m:
        write(m, KEYS[:4], size=MIB)  # fills the first 4 MiB segment
        write(m, KEYS[4:6], size=MIB)
        assert m.pool.committed_bytes == 8 * MIB
        assert m.l1.contains(KEYS[:6]) == [True] * 6


def test_close_stops_every_thread_and_removes_the_shared_memory(
    shm_dir: str, clock: FakeClock
) -> None:
    before = {t.ident for t in threading.enumerate()}
    adapter = FakeL2()
    m = StorageManager(
        "n1",
        8 * MIB,
        l2_adapters=[adapter],
        options=options(shm_dir, background_threads=True, eviction_period_s=0.05),
        clock=clock,
    )
    write(m, KEYS[:2])
    handle = m.submit_prefetch("r", [KEYS[:2]], 1)
    assert m.query_prefetch(handle) is not None
    assert os.listdir(shm_dir)
    m.close()
    m.close()
    leftover = [
        t.name
        for t in threading.enumerate()
        if t.ident not in before and t.name.startswith("kvmesh")
    ]
    assert leftover == []
    assert os.listdir(shm_dir) == []
    assert adapter.closed
