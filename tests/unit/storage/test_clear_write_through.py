"""Clear never drops an object whose L2 write-through is still owed (StorageManager.clear).

The write-through of a stored object is owed while it waits in the store
controller's queue or is being written. Clear keeps such objects until the
queue has handled them, then drops them too; when that takes longer than
its timeout it raises Unavailable, having cleared everything else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvmesh.common.errors import Unavailable
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.l2.base import L2Adapter
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.options import StorageOptions
from tests.support.waiting import wait_until
from tests.unit.storage.helpers import MIB, FakeClock, FakeL2, make_key

CHUNK = 64 * 1024
KEYS = [make_key(i) for i in range(12)]

MakeManager = Callable[..., StorageManager]


@pytest.fixture
def make_manager(shm_dir: str, clock: FakeClock) -> Iterator[MakeManager]:
    managers: list[StorageManager] = []

    def make(adapters: Sequence[L2Adapter]) -> StorageManager:
        options = StorageOptions(
            segment_bytes=4 * MIB,
            shm_dir=shm_dir,
            initial_l1_bytes=8 * MIB,
            background_threads=False,
        )
        manager = StorageManager(
            f"node{len(managers)}", 8 * MIB, l2_adapters=adapters, options=options, clock=clock
        )
        managers.append(manager)
        assert manager.wait_l2_index(10)
        return manager

    yield make
    for manager in managers:
        manager.close()


def write(m: StorageManager, keys: Sequence[ObjectKey]) -> None:
    """Store keys as a client would (their write-through is queued, not awaited)."""
    objs = m.reserve_write(keys, CHUNK)
    for key in keys:
        objs[key].view()[:] = (key.chunk_hash * (CHUNK // 32))[:CHUNK]
    assert m.finish_write(keys) == [L1Result.SUCCESS] * len(keys)


def test_clear_keeps_owed_objects_until_they_are_written_then_drops_them(
    make_manager: MakeManager,
) -> None:
    adapter = FakeL2()
    m = make_manager([adapter])
    write(m, KEYS[:2])
    assert m.flush_l2_writes(10)  # written through: nothing owed for these
    adapter.block_put = threading.Event()
    write(m, KEYS[2:6])
    assert adapter.put_entered.wait(10)  # this batch is being written ...
    write(m, KEYS[6:9])  # ... and these wait in the queue
    assert m.store.owed_keys() == set(KEYS[2:9])

    result: list[tuple[int, int]] = []
    clearing = threading.Thread(target=lambda: result.append(m.clear(force=True)))
    clearing.start()
    # What nothing is owed for goes at once; the owed objects stay for their writes.
    wait_until(lambda: m.l1.contains(KEYS[:2]) == [False, False])
    assert m.l1.contains(KEYS[2:9]) == [True] * 7
    adapter.block_put.set()
    clearing.join(10)
    assert result == [(9, 0)]
    assert m.l1.resident_count == 0
    assert set(adapter.objects) == set(KEYS[:9])
    assert m.store.stats()["missing_keys"] == 0

    write(m, KEYS[9:])
    assert m.flush_l2_writes(10)
    assert set(adapter.objects) == set(KEYS)


def test_a_clear_whose_owed_writes_do_not_finish_in_time_is_unavailable(
    make_manager: MakeManager,
) -> None:
    adapter = FakeL2()
    m = make_manager([adapter])
    write(m, KEYS[:2])
    assert m.flush_l2_writes(10)
    adapter.block_put = threading.Event()
    write(m, KEYS[2:4])
    assert adapter.put_entered.wait(10)
    write(m, KEYS[4:5])
    with pytest.raises(Unavailable) as info:
        m.clear(force=True, timeout_s=0.0)
    assert info.value.reason == "L2_WRITE_THROUGH_BEHIND"
    # Everything else is gone; the owed objects stay in L1 until written.
    assert m.l1.contains(KEYS[:5]) == [False, False, True, True, True]
    adapter.block_put.set()
    assert m.flush_l2_writes(10)
    assert m.clear(force=True) == (3, 0)
    assert set(adapter.objects) == set(KEYS[:5])


def test_clear_without_l2_drops_everything_at_once(make_manager: MakeManager) -> None:
    m = make_manager([])
    write(m, KEYS[:3])
    assert m.store.owed_keys() == set()
    assert m.clear(force=False, timeout_s=0.0) == (3, 0)
