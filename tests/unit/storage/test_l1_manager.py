"""The L1 state machine: every transition, TTL expiry with an injected clock, listeners."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1.manager import L1Manager
from kvmesh.storage.core.l1.pool import L1Pool
from kvmesh.storage.core.l1.results import L1Result, RemovalReason
from kvmesh.storage.core.l1.table import TTLLock
from tests.unit.storage.helpers import MIB, FakeClock, Recorder, make_key

S = L1Result.SUCCESS
K0, K1, K2 = make_key(0), make_key(1), make_key(2)


def store(l1: L1Manager, keys: Sequence[ObjectKey], size: int = 64 * 1024) -> None:
    results, objs = l1.reserve_write(keys, [size] * len(keys))
    assert results == [S] * len(keys)
    for key in keys:
        objs[key].view()[:4] = key.chunk_hash[:4]
    assert l1.finish_write(keys) == [S] * len(keys)


# -- TTL lock ---------------------------------------------------------------------------


def test_ttl_lock_counts_expires_and_restarts_after_expiry() -> None:
    lock = TTLLock()
    assert not lock.is_locked(0.0)
    lock.lock(2, now=0.0, ttl=10.0)
    assert lock.is_locked(9.9)
    assert not lock.is_locked(10.0)
    lock.lock(1, now=20.0, ttl=10.0)  # expired: restarts at 1, not 3
    assert lock.count == 1
    lock.unlock(5)
    assert lock.count == 0
    assert not lock.is_locked(20.0)


# -- writes -----------------------------------------------------------------------------


def test_staged_objects_are_invisible_until_finish_write(l1: L1Manager) -> None:
    results, objs = l1.reserve_write([K0], [1000])
    assert results == [S]
    assert objs[K0].size == 1000
    assert l1.contains([K0]) == [False]
    assert l1.reserve_read([K0]) == [L1Result.KEY_NOT_EXIST]
    assert l1.staging_count == 1
    assert l1.finish_write([K0]) == [S]
    assert l1.contains([K0]) == [True]
    assert l1.staging_count == 0
    assert l1.resident_bytes == 1000


def test_resident_key_is_not_writable_and_duplicates_are_omitted(l1: L1Manager) -> None:
    store(l1, [K0])
    used = l1.pool.used_bytes
    results, objs = l1.reserve_write([K0, K1], [1000, 1000])
    assert results == [L1Result.KEY_NOT_WRITABLE, S]
    assert list(objs) == [K1]
    assert l1.pool.used_bytes == used + 4096


def test_same_tag_cannot_stage_a_key_twice_while_its_lock_is_live(l1: L1Manager) -> None:
    assert l1.reserve_write([K0], [1000])[0] == [S]
    assert l1.reserve_write([K0], [1000])[0] == [L1Result.KEY_NOT_WRITABLE]
    assert l1.reserve_write([K0, K0], [1000, 1000], tag="other")[0] == [
        S,
        L1Result.KEY_NOT_WRITABLE,
    ]


def test_different_tags_stage_concurrently_and_the_first_finish_wins(
    l1: L1Manager,
) -> None:
    rec = Recorder()
    l1.add_listener(rec)
    _, a = l1.reserve_write([K0], [1000], tag="a")
    _, b = l1.reserve_write([K0], [1000], tag="b")
    assert a[K0] is not b[K0]
    assert l1.finish_write([K0], tag="b") == [S]
    used = l1.pool.used_bytes
    assert l1.finish_write([K0], tag="a") == [S]  # already resident: copy dropped
    assert l1.pool.used_bytes == used - 4096
    assert [c[0] for c in rec.calls] == ["admitted"]


def test_expired_write_reservation_is_handed_to_the_next_writer_of_that_tag(
    l1: L1Manager, clock: FakeClock
) -> None:
    _, first = l1.reserve_write([K0], [1000])
    clock.advance(601)
    results, second = l1.reserve_write([K0], [1000])
    assert results == [S]
    assert second[K0] is first[K0]
    assert l1.staging_count == 1


def test_finish_write_after_the_write_ttl_is_wrong_state_and_frees_memory(
    l1: L1Manager, clock: FakeClock
) -> None:
    l1.reserve_write([K0], [1000])
    clock.advance(600)
    assert l1.finish_write([K0]) == [L1Result.KEY_IN_WRONG_STATE]
    assert l1.contains([K0]) == [False]
    assert l1.pool.used_bytes == 0


def test_finish_write_without_a_reservation_is_key_not_exist(l1: L1Manager) -> None:
    assert l1.finish_write([K0]) == [L1Result.KEY_NOT_EXIST]
    l1.reserve_write([K0], [1000], tag="a")
    assert l1.finish_write([K0], tag="b") == [L1Result.KEY_NOT_EXIST]


def test_finish_write_and_reserve_read_admits_with_n_locks(l1: L1Manager) -> None:
    l1.reserve_write([K0], [1000], tag="p")
    assert l1.finish_write_and_reserve_read([K0], 3, tag="p") == [S]
    assert l1.read_lock_count(K0) == 3
    assert not l1.is_key_evictable(K0)


def test_finish_write_and_reserve_read_locks_the_copy_that_won(l1: L1Manager) -> None:
    l1.reserve_write([K0], [1000], tag="p")
    store(l1, [K0], size=1000)
    assert l1.finish_write_and_reserve_read([K0], 2, tag="p") == [S]
    assert l1.read_lock_count(K0) == 2
    assert l1.staging_count == 0


def test_finish_write_and_delete_discards_the_staged_object(l1: L1Manager) -> None:
    l1.reserve_write([K0], [1000])
    assert l1.finish_write_and_delete([K0]) == [S]
    assert l1.staging_count == 0
    assert l1.pool.used_bytes == 0
    assert l1.finish_write_and_delete([K0]) == [L1Result.KEY_NOT_EXIST]


def test_a_bad_size_raises_before_anything_is_reserved(l1: L1Manager) -> None:
    with pytest.raises(InvalidArgument):
        l1.reserve_write([K0, K1], [1000, 0])
    with pytest.raises(InvalidArgument):
        l1.reserve_write([K0], [l1.pool.max_object_bytes + 1])
    assert l1.staging_count == 0


# -- reads ------------------------------------------------------------------------------


def test_reserve_read_clamps_the_lock_count_to_1_to_128(l1: L1Manager) -> None:
    store(l1, [K0, K1])
    assert l1.reserve_read([K0], 0) == [S]
    assert l1.read_lock_count(K0) == 1
    assert l1.reserve_read([K1], 1000) == [S]
    assert l1.read_lock_count(K1) == 128
    assert l1.reserve_read([K2]) == [L1Result.KEY_NOT_EXIST]


def test_unsafe_read_needs_a_read_lock(l1: L1Manager) -> None:
    store(l1, [K0])
    assert l1.unsafe_read([K0])[0] == [L1Result.KEY_NOT_READABLE]
    assert l1.unsafe_read([K1])[0] == [L1Result.KEY_NOT_EXIST]
    l1.reserve_read([K0])
    results, objs = l1.unsafe_read([K0])
    assert results == [S]
    assert bytes(objs[K0].view()[:4]) == K0.chunk_hash[:4]


def test_finish_read_decrements_and_refuses_an_unlocked_key(l1: L1Manager) -> None:
    store(l1, [K0])
    l1.reserve_read([K0], 2)
    assert l1.finish_read([K0]) == [S]
    assert l1.read_lock_count(K0) == 1
    assert l1.finish_read([K0]) == [S]
    assert l1.finish_read([K0]) == [L1Result.KEY_IN_WRONG_STATE]
    assert l1.finish_read([K1]) == [L1Result.KEY_NOT_EXIST]
    assert l1.contains([K0]) == [True]


def test_read_locks_expire_so_a_crashed_reader_cannot_pin_memory(
    l1: L1Manager, clock: FakeClock
) -> None:
    store(l1, [K0])
    l1.reserve_read([K0], 5)
    assert not l1.is_key_evictable(K0)
    clock.advance(299)
    assert not l1.is_key_evictable(K0)
    clock.advance(1)
    assert l1.is_key_evictable(K0)
    assert l1.unsafe_read([K0])[0] == [L1Result.KEY_NOT_READABLE]
    assert l1.delete([K0]) == [S]


def test_temporary_object_is_freed_when_its_last_reader_releases_it(l1: L1Manager) -> None:
    rec = Recorder()
    l1.add_listener(rec)
    l1.reserve_write([K0], [1000], tag="p", temporary=True, from_l2=True)
    l1.finish_write_and_reserve_read([K0], 2, tag="p")
    assert rec.calls == [("admitted", [K0], True)]
    l1.finish_read([K0])
    assert l1.contains([K0]) == [True]
    l1.finish_read([K0])
    assert l1.contains([K0]) == [False]
    assert l1.pool.used_bytes == 0
    assert rec.calls[-1] == ("removed", [K0], RemovalReason.RELEASED)


def test_temporary_object_whose_locks_expired_is_reaped(l1: L1Manager, clock: FakeClock) -> None:
    l1.reserve_write([K0], [1000], tag="p", temporary=True, from_l2=True)
    l1.finish_write_and_reserve_read([K0], 1, tag="p")
    assert l1.reap() == 0
    clock.advance(300)
    assert l1.reap() == 1
    assert l1.contains([K0]) == [False]
    assert l1.pool.used_bytes == 0


def test_reap_frees_staging_left_by_a_crashed_writer(l1: L1Manager, clock: FakeClock) -> None:
    l1.reserve_write([K0, K1], [1000, 1000])
    clock.advance(599)
    assert l1.reap() == 0
    clock.advance(1)
    assert l1.reap() == 2
    assert l1.staging_count == 0
    assert l1.pool.used_bytes == 0


# -- removal ----------------------------------------------------------------------------


def test_delete_refuses_locked_objects_and_live_staging_unless_forced(l1: L1Manager) -> None:
    store(l1, [K0])
    l1.reserve_read([K0])
    l1.reserve_write([K1], [1000])
    assert l1.delete([K0, K1, K2]) == [
        L1Result.KEY_IS_LOCKED,
        L1Result.KEY_IS_LOCKED,
        L1Result.KEY_NOT_EXIST,
    ]
    assert l1.contains([K0]) == [True]


def test_delete_reclaims_expired_staging(l1: L1Manager, clock: FakeClock) -> None:
    l1.reserve_write([K0], [1000])
    clock.advance(601)
    assert l1.delete([K0]) == [S]
    assert l1.pool.used_bytes == 0


def test_forced_delete_of_a_read_object_keeps_memory_until_the_reader_is_done(
    l1: L1Manager,
) -> None:
    rec = Recorder()
    l1.add_listener(rec)
    store(l1, [K0])
    l1.reserve_read([K0])
    _, objs = l1.unsafe_read([K0])
    assert l1.delete([K0], force=True) == [S]
    assert l1.contains([K0]) == [False]
    assert rec.calls[-1] == ("removed", [K0], RemovalReason.DELETED)
    # The reader is still copying: its memory must not be handed out.
    assert l1.pool.used_bytes == objs[K0].capacity
    assert not objs[K0].released
    assert l1.finish_read([K0]) == [S]
    assert objs[K0].released
    assert l1.pool.used_bytes == 0


def test_forced_delete_of_staging_frees_it_when_the_writer_finishes(l1: L1Manager) -> None:
    _, objs = l1.reserve_write([K0], [1000])
    assert l1.delete([K0], force=True) == [S]
    assert not objs[K0].released
    assert l1.finish_write([K0]) == [L1Result.KEY_NOT_EXIST]
    assert objs[K0].released
    assert l1.contains([K0]) == [False]


def test_doomed_memory_whose_lock_expired_is_reaped(l1: L1Manager, clock: FakeClock) -> None:
    store(l1, [K0])
    l1.reserve_read([K0])
    l1.delete([K0], force=True)
    assert l1.reap() == 0
    clock.advance(300)
    assert l1.reap() == 1
    assert l1.pool.used_bytes == 0


def test_clear_skips_locked_keys_unless_forced(l1: L1Manager) -> None:
    store(l1, [K0, K1])
    l1.reserve_read([K0])
    assert l1.clear() == (1, 1)
    assert l1.contains([K0, K1]) == [True, False]
    assert l1.clear(force=True) == (1, 0)
    assert l1.resident_count == 0


def test_evict_takes_only_evictable_keys(l1: L1Manager) -> None:
    rec = Recorder()
    l1.add_listener(rec)
    store(l1, [K0, K1])
    l1.reserve_read([K0])
    evicted, freed = l1.evict([K0, K1, K2])
    assert evicted == [K1]
    assert freed == 65536
    assert rec.calls[-1] == ("removed", [K1], RemovalReason.EVICTED)


# -- memory pressure, salts, listeners, atomicity -------------------------------------------


def test_out_of_memory_keys_are_omitted_and_the_rest_succeed(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1 = L1Manager(make_pool(4 * MIB), clock=clock)
    results, objs = l1.reserve_write([K0, K1, K2], [3 * MIB, 2 * MIB, MIB])
    assert results == [S, L1Result.OUT_OF_MEMORY, S]
    assert set(objs) == {K0, K2}
    assert l1.oom_keys == 1


def test_allocation_failure_calls_reclaim_then_retries_once(
    make_pool: Callable[..., L1Pool], clock: FakeClock
) -> None:
    l1 = L1Manager(make_pool(4 * MIB), clock=clock)
    store(l1, [K0], size=3 * MIB)
    asked: list[list[int]] = []

    def reclaim(sizes: Sequence[int]) -> None:
        asked.append(list(sizes))
        l1.evict([K0])

    l1.set_reclaim(reclaim)
    results, objs = l1.reserve_write([K1], [2 * MIB])
    assert results == [S]
    assert asked == [[2 * MIB]]
    assert K1 in objs


def test_bytes_are_tracked_per_cache_salt(l1: L1Manager) -> None:
    a0, a1, b0 = make_key(0, salt="a"), make_key(1, salt="a"), make_key(0, salt="b")
    store(l1, [a0, a1], size=1000)
    store(l1, [b0, K0], size=3000)
    assert l1.bytes_by_salt() == {"a": 2000, "b": 3000, "": 3000}
    l1.delete([a0, a1])
    assert l1.bytes_by_salt() == {"b": 3000, "": 3000}


def test_listeners_see_admission_touch_and_removal_in_order(l1: L1Manager) -> None:
    rec = Recorder()
    l1.add_listener(rec)
    store(l1, [K0, K1])
    assert l1.touch([K1, K2]) == 1
    l1.delete([K0])
    assert rec.calls == [
        ("admitted", [K0, K1], False),
        ("touched", [K1], None),
        ("removed", [K0], RemovalReason.DELETED),
    ]


def test_concurrent_writers_reserve_each_key_exactly_once(l1: L1Manager) -> None:
    keys = [make_key(i) for i in range(40)]
    won: list[list[ObjectKey]] = [[], [], [], []]
    start = threading.Barrier(4)

    def writer(i: int) -> None:
        start.wait()
        results, _ = l1.reserve_write(keys, [4096] * len(keys))
        won[i] = [k for k, r in zip(keys, results, strict=True) if r is S]

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(k for w in won for k in w) == sorted(keys)
    assert l1.staging_count == len(keys)


def test_stats_count_objects_by_state(l1: L1Manager) -> None:
    store(l1, [K0, K1])
    l1.reserve_read([K0])
    l1.reserve_write([K2], [100])
    stats = l1.stats()
    assert stats["resident_objects"] == 2
    assert stats["read_locked_objects"] == 1
    assert stats["staging_objects"] == 1
    assert stats["staging_bytes"] == 100
    assert stats["resident_bytes"] == 2 * 65536
