"""Store and prefetch controllers through the StorageManager, with an in-test L2 adapter."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvmesh.common.errors import InvalidArgument, NotFound
from kvmesh.common.events import EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.controllers.prefetch_types import PrefetchPolicy, PrefetchResult
from kvmesh.storage.core.controllers.store import StorePolicy
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.l2.base import L2Adapter
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.options import StorageOptions
from tests.unit.storage.helpers import MIB, FakeClock, FakeL2, RecordingSink, make_key

CHUNK = 256 * 1024
S = L1Result.SUCCESS
KEYS = [make_key(i) for i in range(16)]
ROW1 = [make_key(i, rank=1) for i in range(16)]

MakeManager = Callable[..., StorageManager]


def payload(key: ObjectKey, size: int = CHUNK) -> bytes:
    return (key.chunk_hash * (size // 32 + 1))[:size]


@pytest.fixture
def make_manager(shm_dir: str, clock: FakeClock) -> Iterator[MakeManager]:
    managers: list[StorageManager] = []

    def make(
        adapters: Sequence[L2Adapter] = (),
        *,
        capacity: int = 8 * MIB,
        sink: RecordingSink | None = None,
        **opts: object,
    ) -> StorageManager:
        options = StorageOptions(
            segment_bytes=4 * MIB,
            shm_dir=shm_dir,
            initial_l1_bytes=capacity,
            background_threads=False,
            **opts,  # type: ignore[arg-type]
        )
        manager = StorageManager(
            f"node{len(managers)}",
            capacity,
            l2_adapters=adapters,
            event_sink=sink,
            options=options,
            clock=clock,
        )
        managers.append(manager)
        assert manager.wait_l2_index(10)
        return manager

    yield make
    for manager in managers:
        manager.close()


def write(
    m: StorageManager, keys: Sequence[ObjectKey], size: int = CHUNK, *, flush: bool = True
) -> None:
    """Store keys as a client would; by default wait for the L2 write-through (and its lock)."""
    objs = m.reserve_write(keys, size)
    assert set(objs) == set(keys)
    for key in keys:
        objs[key].view()[:] = payload(key, size)
    assert m.finish_write(keys) == [S] * len(keys)
    if flush:
        assert m.flush_l2_writes(10)


def seed(adapter: FakeL2, keys: Sequence[ObjectKey], size: int = CHUNK) -> None:
    for key in keys:
        adapter.put_bytes(key, payload(key, size))


def result_of(m: StorageManager, rows: Sequence[Sequence[ObjectKey]], n: int = 1) -> PrefetchResult:
    handle = m.submit_prefetch("req", rows, n, row_nbytes=[CHUNK] * len(rows))
    assert m.wait_prefetch(handle, 10)
    result = m.query_prefetch(handle)
    assert result is not None
    return result


# -- store controller ----------------------------------------------------------------------


def test_client_writes_are_written_through_to_every_adapter(make_manager: MakeManager) -> None:
    a, b = FakeL2(backend="a"), FakeL2(backend="b")
    sink = RecordingSink()
    m = make_manager([a, b], sink=sink)
    write(m, KEYS[:3])
    assert m.flush_l2_writes(10)
    for adapter in (a, b):
        assert {k: adapter.objects[k] for k in KEYS[:3]} == {k: payload(k) for k in KEYS[:3]}
    assert m.l1.contains(KEYS[:3]) == [True] * 3  # default policy keeps L1
    assert sink.keys_of(EventType.STORE, Tier.L1) == KEYS[:3]
    assert sorted(sink.keys_of(EventType.STORE, Tier.L2)) == sorted(KEYS[:3] * 2)
    assert m.status()["store"]["stored_keys"] == 3


def test_the_l1_object_is_read_locked_while_l2_writes_it(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    adapter.block_put = threading.Event()
    m = make_manager([adapter])
    write(m, [KEYS[0]], flush=False)
    assert adapter.put_entered.wait(10)
    assert m.l1.read_lock_count(KEYS[0]) == 1
    assert m.delete([KEYS[0]], Tier.L1) == (0, 1), "locked during the L2 write"
    adapter.block_put.set()
    assert m.flush_l2_writes(10)
    assert m.l1.read_lock_count(KEYS[0]) == 0


def test_a_write_through_that_outlasts_its_l1_lock_deletes_what_it_wrote(
    make_manager: MakeManager, clock: FakeClock
) -> None:
    adapter = FakeL2()
    adapter.block_put = threading.Event()
    m = make_manager([adapter])
    write(m, [KEYS[0]], flush=False)
    assert adapter.put_entered.wait(10)
    # The disk stalls past the read lock's TTL: the lock lapses, another reader locks
    # the object anew (the memory could as well have been evicted and reused).
    clock.advance(m.l1.read_ttl_s + 1)
    assert m.l1.reserve_read([KEYS[0]], 1) == [S]
    adapter.block_put.set()
    assert m.flush_l2_writes(10)
    assert KEYS[0] not in adapter.objects, "bytes written past the lock were kept in L2"
    assert m.l1.read_lock_count(KEYS[0]) == 1, "the lapsed lock's release took the new reader's"
    m.l1.finish_read([KEYS[0]], 1)


def test_skip_l1_policy_keeps_objects_only_in_l2(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    sink = RecordingSink()
    m = make_manager([adapter], sink=sink, store_policy=StorePolicy.SKIP_L1)
    write(m, KEYS[:2])
    assert m.flush_l2_writes(10)
    assert m.l1.contains(KEYS[:2]) == [False, False]
    assert set(adapter.objects) == set(KEYS[:2])
    assert sink.keys_of(EventType.DELETE, Tier.L1) == KEYS[:2]


def test_an_adapter_down_during_a_store_degrades_and_recovers_after_backoff(
    make_manager: MakeManager, clock: FakeClock
) -> None:
    adapter = FakeL2()
    m = make_manager([adapter])
    adapter.down = True
    write(m, [KEYS[0]])
    assert m.flush_l2_writes(10)
    l2 = m.status()["l2"][0]
    assert l2["degraded"]
    assert not l2["healthy"]
    assert m.l1.contains([KEYS[0]]) == [True], "the node goes on L1-only"
    # Within the backoff the adapter is not even called.
    adapter.down = False
    write(m, [KEYS[1]])
    assert m.flush_l2_writes(10)
    assert adapter.objects == {}
    assert m.status()["store"]["skipped_keys"] == 1
    clock.advance(5.0)
    write(m, [KEYS[2]])
    assert m.flush_l2_writes(10)
    assert set(adapter.objects) == {KEYS[2]}
    assert m.status()["l2"][0]["healthy"]


def test_objects_loaded_from_l2_are_not_written_back(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    m = make_manager([adapter])
    seed(adapter, KEYS[:2])
    result = result_of(m, [KEYS[:2]])
    assert result.hit_chunks == 2
    assert m.flush_l2_writes(10)
    assert adapter.put_log == []


# -- prefetch: L1 --------------------------------------------------------------------------


def test_an_l1_only_lookup_is_complete_when_submit_returns(make_manager: MakeManager) -> None:
    m = make_manager([FakeL2()])
    write(m, KEYS[:4])
    handle = m.submit_prefetch("r1", [KEYS[:4]], 2)
    result = m.query_prefetch(handle)
    assert result is not None
    assert result.hit_chunks == 4
    assert result.l1_hit_cells == 4
    assert result.l2_hit_cells == 0
    assert result.locked_keys == tuple(KEYS[:4])
    assert [m.l1.read_lock_count(k) for k in KEYS[:4]] == [2] * 4
    assert m.status()["prefetch"]["completed_l1_only"] == 1


def test_a_prefetch_result_is_returned_exactly_once(make_manager: MakeManager) -> None:
    m = make_manager()
    write(m, KEYS[:1])
    handle = m.submit_prefetch("r1", [KEYS[:1]], 1)
    assert m.query_prefetch(handle) is not None
    with pytest.raises(NotFound):
        m.query_prefetch(handle)
    with pytest.raises(NotFound):
        m.wait_prefetch(handle, 0)


def test_l1_locks_after_the_first_l1_miss_are_released_without_adapters(
    make_manager: MakeManager,
) -> None:
    m = make_manager()
    write(m, [KEYS[0], KEYS[1], KEYS[3]])
    result = result_of(m, [KEYS[:4]])
    assert result.hit_chunks == 2
    assert m.l1.read_lock_count(KEYS[3]) == 0


def test_empty_and_ragged_requests(make_manager: MakeManager) -> None:
    m = make_manager()
    handle = m.submit_prefetch("r", [], 1)
    result = m.query_prefetch(handle)
    assert result is not None
    assert result.hit_chunks == 0
    with pytest.raises(InvalidArgument):
        m.submit_prefetch("r", [KEYS[:2], ROW1[:1]], 1)
    with pytest.raises(InvalidArgument):
        m.submit_prefetch("r", [KEYS[:2]], 1, row_nbytes=[0])


# -- prefetch: L2 --------------------------------------------------------------------------


def test_partial_l2_hits_load_only_the_contiguous_prefix(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    m = make_manager([adapter])
    write(m, KEYS[:2])
    seed(adapter, [KEYS[2], KEYS[3], KEYS[5]])  # chunk 4 is missing everywhere
    result = result_of(m, [KEYS[:6]], n=2)
    assert result.hit_chunks == 4
    assert result.l1_hit_cells == 2
    assert result.l2_hit_cells == 2
    assert adapter.get_log == [KEYS[2], KEYS[3]], "chunk 5 is after the first miss: never loaded"
    objs = m.unsafe_read(KEYS[:4])
    assert bytes(objs[KEYS[3]].view()) == payload(KEYS[3])
    assert [m.l1.read_lock_count(k) for k in KEYS[:4]] == [2] * 4


def test_a_chunk_counts_only_when_every_row_has_it(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    m = make_manager([adapter])
    seed(adapter, KEYS[:4])
    seed(adapter, ROW1[:2])
    result = result_of(m, [KEYS[:4], ROW1[:4]])
    assert result.hit_chunks == 2
    assert result.locked_keys == (KEYS[0], KEYS[1], ROW1[0], ROW1[1])
    assert set(adapter.get_log) == {KEYS[0], KEYS[1], ROW1[0], ROW1[1]}


def test_a_failed_load_shortens_the_prefix_and_releases_the_rest(
    make_manager: MakeManager,
) -> None:
    adapter = FakeL2()
    m = make_manager([adapter])
    seed(adapter, KEYS[:6])
    adapter.fail_get = {KEYS[3]}
    result = result_of(m, [KEYS[:6]])
    assert result.hit_chunks == 3
    assert m.l1.contains(KEYS[:6]) == [True, True, True, False, False, False]
    assert m.l1.staging_count == 0
    assert m.status()["prefetch"]["l2_failed_cells"] == 1


def test_l1_out_of_memory_shortens_the_prefix(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    m = make_manager([adapter], capacity=4 * MIB)
    seed(adapter, KEYS[:6], size=MIB)
    handle = m.submit_prefetch("r", [KEYS[:6]], 1, row_nbytes=[MIB])
    assert m.wait_prefetch(handle, 10)
    result = m.query_prefetch(handle)
    assert result is not None
    assert result.hit_chunks == 4
    assert m.status()["prefetch"]["oom_cells"] == 2
    assert KEYS[4] not in adapter.get_log


def test_temporary_loads_are_freed_after_the_read_and_retained_ones_stay(
    make_manager: MakeManager,
) -> None:
    for policy, stays in ((PrefetchPolicy.DEFAULT, False), (PrefetchPolicy.RETAIN, True)):
        adapter = FakeL2()
        m = make_manager([adapter], prefetch_policy=policy)
        seed(adapter, KEYS[:2])
        result = result_of(m, [KEYS[:2]], n=2)
        m.finish_read(result.locked_keys, 1)
        assert m.l1.contains(KEYS[:2]) == [True, True]
        m.finish_read(result.locked_keys, 1)
        assert m.l1.contains(KEYS[:2]) == [stays, stays], policy


def test_loads_report_l2_access_and_l1_placements(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    sink = RecordingSink()
    m = make_manager([adapter], sink=sink)
    seed(adapter, KEYS[:2])
    result = result_of(m, [KEYS[:2]])
    assert sink.keys_of(EventType.ACCESS, Tier.L2) == KEYS[:2]
    assert sink.keys_of(EventType.STORE, Tier.L1) == KEYS[:2]
    m.finish_read(result.locked_keys)
    assert sink.keys_of(EventType.DELETE, Tier.L1) == KEYS[:2]


def test_sizes_come_from_the_adapter_index_or_the_row_and_unknown_sizes_miss(
    make_manager: MakeManager,
) -> None:
    adapter = FakeL2()
    seed(adapter, KEYS[:2])  # present at start: indexed with their sizes
    m = make_manager([adapter])
    seed(adapter, [KEYS[2], KEYS[3]])  # added behind the node's back: sizes unknown
    handle = m.submit_prefetch("r", [KEYS[:4]], 1)
    assert m.wait_prefetch(handle, 10)
    result = m.query_prefetch(handle)
    assert result is not None
    assert result.hit_chunks == 2
    write(m, [ROW1[0]])
    seed(adapter, [ROW1[1]])
    handle = m.submit_prefetch("r", [ROW1[:2]], 1)  # size taken from the row's L1 object
    assert m.wait_prefetch(handle, 10)
    result = m.query_prefetch(handle)
    assert result is not None
    assert result.hit_chunks == 2


def test_wait_times_out_while_loading_and_the_result_follows(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    adapter.block_get = threading.Event()
    m = make_manager([adapter])
    seed(adapter, KEYS[:2])
    handle = m.submit_prefetch("r", [KEYS[:2]], 1, row_nbytes=[CHUNK])
    assert adapter.get_entered.wait(10)
    assert not m.wait_prefetch(handle, 0.01)
    assert m.query_prefetch(handle) is None
    adapter.block_get.set()
    assert m.wait_prefetch(handle, 10)
    result = m.query_prefetch(handle)
    assert result is not None
    assert result.hit_chunks == 2


def test_requests_beyond_max_in_flight_wait_in_fifo_order(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    adapter.block_get = threading.Event()
    m = make_manager([adapter], prefetch_max_in_flight=1)
    seed(adapter, KEYS[:3])
    first = m.submit_prefetch("a", [KEYS[:1]], 1, row_nbytes=[CHUNK])
    assert adapter.get_entered.wait(10)
    second = m.submit_prefetch("b", [KEYS[1:2]], 1, row_nbytes=[CHUNK])
    third = m.submit_prefetch("c", [KEYS[2:3]], 1, row_nbytes=[CHUNK])
    stats = m.status()["prefetch"]
    assert (stats["in_flight"], stats["queued"]) == (1, 2)
    adapter.block_get.set()
    for handle in (first, second, third):
        assert m.wait_prefetch(handle, 10)
        result = m.query_prefetch(handle)
        assert result is not None
        assert result.hit_chunks == 1
    assert adapter.get_log == KEYS[:3]


def test_an_adapter_down_at_lookup_gives_the_l1_prefix_and_degrades(
    make_manager: MakeManager,
) -> None:
    adapter = FakeL2()
    m = make_manager([adapter])
    write(m, KEYS[:2])
    seed(adapter, KEYS[2:4])
    adapter.down = True
    result = result_of(m, [KEYS[:4]])
    assert result.hit_chunks == 2
    assert not result.error
    assert m.status()["l2"][0]["degraded"]


def test_an_adapter_raising_anything_is_treated_as_unavailable(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    m = make_manager([adapter])
    seed(adapter, KEYS[:2])
    adapter.contains_raises = True
    result = result_of(m, [KEYS[:2]])
    assert result.hit_chunks == 0
    assert m.status()["l2"][0]["degraded"]
    assert "contains exploded" in m.status()["l2"][0]["last_error"]


def test_a_key_being_loaded_is_pinned_against_l2_deletes(make_manager: MakeManager) -> None:
    adapter = FakeL2()
    adapter.block_get = threading.Event()
    m = make_manager([adapter])
    seed(adapter, KEYS[:1])
    handle = m.submit_prefetch("r", [KEYS[:1]], 1, row_nbytes=[CHUNK])
    assert adapter.get_entered.wait(10)
    assert m.delete([KEYS[0]], Tier.L2) == (0, 1)
    adapter.block_get.set()
    assert m.wait_prefetch(handle, 10)
    result = m.query_prefetch(handle)
    assert result is not None
    assert result.hit_chunks == 1
    assert m.delete([KEYS[0]], Tier.L2) == (1, 0)


def test_an_unqueried_result_expires_and_releases_its_locks(
    make_manager: MakeManager, clock: FakeClock
) -> None:
    m = make_manager()
    write(m, KEYS[:1])
    handle = m.submit_prefetch("r", [KEYS[:1]], 1)
    clock.advance(241)  # 0.8 of the 300 s read TTL: before the lock could lapse
    assert m.l1.read_lock_count(KEYS[0]) == 1
    m.submit_prefetch("other", [], 1)  # any call sweeps
    assert m.status()["prefetch"]["expired_results"] == 1
    assert m.l1.read_lock_count(KEYS[0]) == 0  # released, not left to lapse
    with pytest.raises(NotFound):
        m.query_prefetch(handle)


def test_an_unqueried_result_swept_after_its_locks_lapsed_spares_newer_readers(
    make_manager: MakeManager, clock: FakeClock
) -> None:
    # No call swept the result until its lock lapsed, and a new reader locked the
    # chunk afresh: releasing the result's count would take that reader's lock.
    m = make_manager()
    write(m, KEYS[:1])
    m.submit_prefetch("r", [KEYS[:1]], 2)
    clock.advance(301)
    assert m.reserve_read(KEYS[:1], 1) == [L1Result.SUCCESS]
    m.submit_prefetch("other", [], 1)
    assert m.status()["prefetch"]["expired_results"] == 1
    assert m.l1.read_lock_count(KEYS[0]) == 1


def test_the_memory_adapter_round_trips_through_l2(make_manager: MakeManager) -> None:
    memory = pytest.importorskip("kvmesh.storage.core.l2.memory")
    adapter = memory.MemoryL2Adapter()
    m = make_manager([adapter])
    write(m, KEYS[:3])
    assert m.flush_l2_writes(10)
    assert m.clear() == (3, 0)
    result = result_of(m, [KEYS[:3]])
    assert result.hit_chunks == 3
    assert result.l2_hit_cells == 3
    objs = m.unsafe_read(KEYS[:3])
    assert all(bytes(objs[k].view()) == payload(k) for k in KEYS[:3])


# -- prefetch: a miss answered from the L2 index ---------------------------------------------


class SoleWriterL2(FakeL2):
    """An adapter nothing else writes (like a local directory it locks)."""

    sole_writer = True


def test_a_miss_on_a_sole_writer_is_answered_at_submit_without_asking_it(
    make_manager: MakeManager,
) -> None:
    adapter = SoleWriterL2()
    m = make_manager([adapter])
    write(m, KEYS[:2])
    adapter.contains_raises = True  # asking the adapter would fail the lookup's L2 part
    handle = m.submit_prefetch("r", [KEYS[:4], ROW1[:4]], 1, row_nbytes=[CHUNK, CHUNK])
    result = m.query_prefetch(handle)  # no wait: complete when submit returned
    assert result is not None
    assert result.hit_chunks == 0  # ROW1 holds nothing: no column is whole
    assert [m.l1.read_lock_count(k) for k in KEYS[:2]] == [0, 0]
    assert m.status()["prefetch"]["completed_by_index"] == 1
    assert not m.status()["l2"][0]["degraded"]


def test_a_chunk_in_the_sole_writers_index_is_still_loaded(make_manager: MakeManager) -> None:
    adapter = SoleWriterL2()
    m = make_manager([adapter])
    write(m, KEYS[:3])  # written through to the adapter: in its index
    assert m.delete(KEYS[1:3], Tier.L1) == (2, 0)
    result = result_of(m, [KEYS[:4]])
    assert result.hit_chunks == 3
    assert result.l2_hit_cells == 2
    assert adapter.get_log == KEYS[1:3]
    assert m.status()["prefetch"]["completed_by_index"] == 0


def test_an_adapter_that_others_may_write_is_always_asked(make_manager: MakeManager) -> None:
    shared = SoleWriterL2(shared=True)  # a shared pool: another node may have written it
    plain = FakeL2()  # says nothing: asked as before
    for adapter in (shared, plain):
        m = make_manager([adapter])
        seed(adapter, KEYS[:2])  # not in this node's index
        result = result_of(m, [KEYS[:2]])
        assert result.hit_chunks == 2
        assert m.status()["prefetch"]["completed_by_index"] == 0


def test_the_index_answers_only_once_it_is_complete(make_manager: MakeManager) -> None:
    adapter = SoleWriterL2()
    m = make_manager([adapter])
    tier = m.tiers[0]
    assert tier.sole_writer
    assert tier.surely_absent(KEYS[0])
    tier.index_state = "building"  # a resync listing the adapter again
    assert not tier.surely_absent(KEYS[0])
    seed(adapter, KEYS[:1])
    assert result_of(m, [KEYS[:1]]).hit_chunks == 1


class FakePeers:
    """A PeerSource that finds nothing; ``lonely`` is what alone() says."""

    def __init__(self, lonely: bool) -> None:
        self.lonely = lonely
        self.asked: list[str] = []

    def alone(self) -> bool:
        return self.lonely

    def submit(
        self,
        request_id: str,
        rows: Sequence[Sequence[ObjectKey]],
        readers: int,
        row_nbytes: Sequence[int] | None,
        done: Callable[[int], None],
    ) -> None:
        self.asked.append(request_id)
        done(0)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("lonely", [True, False])
def test_peers_are_asked_unless_the_node_is_known_to_be_alone(
    make_manager: MakeManager, lonely: bool
) -> None:
    m = make_manager([SoleWriterL2()])
    peers = FakePeers(lonely)
    m.prefetch.set_peer_source(peers)
    result = result_of(m, [KEYS[:2]])
    assert result.hit_chunks == 0
    assert peers.asked == ([] if lonely else ["req"])
    assert m.status()["prefetch"]["completed_by_index"] == (1 if lonely else 0)


def test_a_prefetch_finishing_past_the_read_ttl_spares_newer_readers_of_its_hits(
    make_manager: MakeManager, clock: FakeClock
) -> None:
    # Row 0 holds both chunks in L1, row 1 only the first; row 1's second comes from
    # an L2 load that outlasts the read TTL and fails. The prefix is then one chunk,
    # and the lock the prefetch took at its start on row 0's second chunk lapsed
    # meanwhile: a new reader holds it now, and the prefetch must not release that.
    a, b = [make_key(100), make_key(101)], [make_key(200), make_key(201)]
    adapter = FakeL2()
    seed(adapter, b[1:])
    adapter.fail_get.add(b[1])
    adapter.block_get = threading.Event()
    m = make_manager([adapter])
    write(m, [*a, b[0]])
    handle = m.submit_prefetch("r", [a, b], 1, row_nbytes=[CHUNK, CHUNK])
    assert adapter.get_entered.wait(10)
    clock.advance(301)
    assert m.reserve_read(a[1:], 1) == [S]
    adapter.block_get.set()
    assert m.wait_prefetch(handle, 10)
    result = m.query_prefetch(handle)
    assert result is not None
    assert result.hit_chunks == 1
    assert m.l1.read_lock_count(a[1]) == 1
