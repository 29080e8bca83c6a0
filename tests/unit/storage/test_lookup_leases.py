"""The lookup lease: every read lock a lookup took leaves storage exactly once.

Against a real StorageManager (L1 lock counts are read off L1 itself): a
lookup's locks become a lease when its result is delivered, and consume,
release, end, expiry and the owner's end each take them out once, in any
order — a copy that fails after consuming included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.copies import ChunkCopier
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.node_lookups import NodeLookups
from kvmesh.storage.core.options import StorageOptions
from tests.unit.storage.helpers import MIB, FakeClock, make_key

CHUNK = 64 * 1024
KEYS = [make_key(i) for i in range(4)]


@pytest.fixture
def manager(shm_dir: str, clock: FakeClock) -> Iterator[StorageManager]:
    options = StorageOptions(
        segment_bytes=4 * MIB, shm_dir=shm_dir, background_threads=False, read_ttl_s=300.0
    )
    m = StorageManager("leases", 8 * MIB, options=options, clock=clock)
    reserved = m.reserve_write(KEYS, CHUNK)
    assert set(reserved) == set(KEYS)
    m.finish_write(KEYS)
    yield m
    m.close()


def _lookups(manager: StorageManager, clock: FakeClock, ttl_s: float = 60.0) -> NodeLookups:
    ids = iter(range(1, 1000))
    lookups = NodeLookups(
        manager, new_id=lambda p: f"{p}-{next(ids)}-test", max_chunks=64, lease_ttl_s=ttl_s
    )
    lookups.leases.clock = clock
    return lookups


def _lease(lookups: NodeLookups, keys: list[ObjectKey], readers: int = 1, owner: str = "") -> str:
    state = asyncio.run(lookups.lookup_and_lock("r", [keys], readers, 1000, owner=owner))
    assert state.completed
    assert state.hit_chunks == len(keys)
    assert state.lease_ttl_ms > 0
    return state.prefetch_id


def _locks(manager: StorageManager) -> list[int]:
    return [manager.l1.read_lock_count(k) for k in KEYS]


def test_consume_then_end_releases_each_lock_once(
    manager: StorageManager, clock: FakeClock
) -> None:
    lookups = _lookups(manager, clock)
    lease = _lease(lookups, KEYS, readers=2)
    assert _locks(manager) == [2, 2, 2, 2]
    mask = lookups.leases.consume(lease, KEYS[:2])
    assert mask == [True, True]
    manager.finish_read([k for k, f in zip(KEYS[:2], mask, strict=True) if f], 1)  # the copy ends
    assert lookups.leases.consume(lease, KEYS[:2]) == [True, True]  # the second reader's
    assert lookups.leases.consume(lease, KEYS[:2]) == [False, False]  # none left
    manager.finish_read(KEYS[:2], 1)
    assert lookups.end_lease(lease) == (True, 4)  # chunks 2 and 3, two readers each
    assert _locks(manager) == [0, 0, 0, 0]
    assert lookups.end_lease(lease) == (False, 0)  # ending twice is harmless


def test_release_a_range_then_end(manager: StorageManager, clock: FakeClock) -> None:
    lookups = _lookups(manager, clock)
    lease = _lease(lookups, KEYS)
    assert lookups.leases.release(lease, 1, 3) == 2
    assert _locks(manager) == [1, 0, 0, 1]
    assert lookups.leases.release(lease, 0, 4) == 2
    assert lookups.end_lease(lease) == (True, 0)
    assert _locks(manager) == [0, 0, 0, 0]


def test_a_copy_failing_after_a_partial_consume_releases_once_and_spares_other_leases(
    manager: StorageManager, clock: FakeClock
) -> None:
    """The gateway's old bookkeeping released these locks twice (dropping another's)."""
    lookups = _lookups(manager, clock)
    mine = _lease(lookups, KEYS)
    other = _lease(lookups, KEYS)  # another request's lookup of the same prefix
    assert _locks(manager) == [2, 2, 2, 2]

    class FailingCopy:
        def scatter_chunks(self, *args: object) -> None:
            raise RuntimeError("engine memory gone mid-copy")

    mask = lookups.leases.consume(mine, KEYS[:3])
    with ThreadPoolExecutor(1) as pool:
        copier = ChunkCopier(manager, FailingCopy(), pool)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="mid-copy"):
            asyncio.run(copier.retrieve("e", KEYS[:3], [[0]] * 3, 16, CHUNK, 0, mask))
    assert _locks(manager) == [1, 1, 1, 2]  # mine released on 0..2 once, kept on 3
    assert lookups.end_lease(mine) == (True, 1)
    assert _locks(manager) == [1, 1, 1, 1]  # the other lease's locks are all still there
    assert lookups.end_lease(other) == (True, 4)
    assert _locks(manager) == [0, 0, 0, 0]


def test_a_lease_ends_its_ttl_after_the_lookup_however_much_it_is_used(
    manager: StorageManager, clock: FakeClock
) -> None:
    lookups = _lookups(manager, clock, ttl_s=10.0)
    idle = _lease(lookups, KEYS[:2])
    used = _lease(lookups, KEYS[2:], readers=3)
    clock.advance(8)
    assert lookups.leases.consume(used, KEYS[2:3]) == [True]  # a use does not extend it
    manager.finish_read(KEYS[2:3], 1)
    assert lookups.leases.release(used, 1, 2) == 3  # nor does a release
    assert _locks(manager) == [1, 1, 2, 0]
    clock.advance(2)
    assert lookups.expire() == 2
    assert _locks(manager) == [0, 0, 0, 0]
    assert lookups.leases.consume(idle, KEYS[:2]) == [False, False]  # gone
    assert lookups.leases.stats.expired == 2
    assert lookups.leases.stats.lapsed_locks == 0


def test_a_lease_used_past_its_ttl_before_the_sweep_ends_there(
    manager: StorageManager, clock: FakeClock
) -> None:
    lookups = _lookups(manager, clock, ttl_s=10.0)
    lease = _lease(lookups, KEYS[:2], readers=2)
    clock.advance(10)
    assert lookups.leases.consume(lease, KEYS[:2]) == [False, False]
    assert lookups.leases.release(lease, 0, 2) == 0
    assert _locks(manager)[:2] == [0, 0]  # released by the use that found it over
    assert lookups.leases.stats.expired == 1


def test_a_lease_found_after_its_locks_lapsed_leaves_newer_readers_locks(
    manager: StorageManager, clock: FakeClock
) -> None:
    # The sweep stalled past the L1 read TTL (300 s): the lease's locks lapsed, and a
    # new reader locked the chunks afresh. Releasing the lease's count would take the
    # new reader's lock, and eviction could reuse memory it is still copying.
    lookups = _lookups(manager, clock, ttl_s=60.0)
    lease = _lease(lookups, KEYS[:2], readers=2)
    clock.advance(301)
    assert manager.reserve_read(KEYS[:2], 1) == [L1Result.SUCCESS] * 2
    assert lookups.expire() == 1
    assert _locks(manager)[:2] == [1, 1]
    assert lookups.leases.stats.lapsed_locks == 4
    assert lookups.end_lease(lease) == (False, 0)


def test_a_lease_ttl_must_stay_below_the_read_lock_ttl(manager: StorageManager) -> None:
    for ttl in (0.0, 300.0, 400.0):
        with pytest.raises(ValueError, match="below the L1 read-lock TTL"):
            NodeLookups(manager, new_id=lambda p: p, max_chunks=64, lease_ttl_s=ttl)


def test_the_end_of_an_owner_ends_its_leases_only(
    manager: StorageManager, clock: FakeClock
) -> None:
    lookups = _lookups(manager, clock)
    _lease(lookups, KEYS[:2], owner="engine-a")
    _lease(lookups, KEYS[1:3], owner="engine-a")
    kept = _lease(lookups, KEYS, owner="engine-b")
    assert lookups.end_owner("engine-a") == 2
    assert _locks(manager) == [1, 1, 1, 1]
    assert lookups.end_owner("engine-a") == 0
    assert lookups.leases.ids() == {kept}
    assert lookups.leases.stats.ended_by_owner == 2


def test_an_unknown_or_old_incarnations_lease_consumes_and_releases_nothing(
    manager: StorageManager, clock: FakeClock
) -> None:
    lookups = _lookups(manager, clock)
    lease = _lease(lookups, KEYS)
    for unknown in ("", "prefetch-1-0ldnode", lease + "x"):
        assert lookups.leases.consume(unknown, KEYS) == [False] * 4
        assert lookups.leases.release(unknown, 0, 4) == 0
        assert lookups.end_lease(unknown) == (False, 0)
    assert _locks(manager) == [1, 1, 1, 1]
    assert lookups.leases.held_locks == 4


def test_a_peers_lock_prefix_is_not_leased(manager: StorageManager, clock: FakeClock) -> None:
    """P2P's LockPrefix takes a lookup's locks itself: no lease may release them too."""
    lookups = _lookups(manager, clock)
    state = asyncio.run(lookups.lookup_and_lock("peer", [KEYS], 1, 1000, leased=False))
    assert state.completed
    assert len(lookups.leases) == 0
    assert lookups.end_lease(state.prefetch_id) == (False, 0)
    assert _locks(manager) == [1, 1, 1, 1]
    manager.finish_read(KEYS, 1)
