"""Prefetch completion without parked threads: done callbacks, node waits, copies, expiry."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmesh.common.errors import NotFound
from kvmesh.storage.core.controllers.prefetch_job import PrefetchHandle
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.l2.base import L2Adapter
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.node import StorageNode
from kvmesh.storage.core.options import StorageOptions
from kvmesh.storage.core.transfer.engine import TransferEngine
from tests.support.waiting import wait_until
from tests.unit.storage.helpers import MIB, FakeClock, FakeL2, make_key

CHUNK = 64 * 1024
KEYS = [make_key(i) for i in range(8)]

MakeManager = Callable[..., StorageManager]


@pytest.fixture
def make_manager(shm_dir: str, clock: FakeClock) -> Iterator[MakeManager]:
    managers: list[StorageManager] = []

    def make(adapters: Sequence[L2Adapter] = ()) -> StorageManager:
        options = StorageOptions(
            segment_bytes=4 * MIB,
            shm_dir=shm_dir,
            background_threads=False,
            read_ttl_s=30.0,
        )
        manager = StorageManager(
            f"waits{len(managers)}", 8 * MIB, l2_adapters=adapters, options=options, clock=clock
        )
        managers.append(manager)
        assert manager.wait_l2_index(10)
        return manager

    yield make
    for manager in managers:
        manager.close()


def seeded_l2(keys: Sequence[object]) -> FakeL2:
    """A fake L2 holding ``keys`` whose loads block until ``block_get`` is set."""
    adapter = FakeL2()
    for key in keys:
        adapter.put_bytes(key, b"x" * CHUNK)  # type: ignore[arg-type]
    adapter.block_get = threading.Event()
    return adapter


# -- the controller's done callbacks ------------------------------------------------------


def test_a_done_callback_runs_on_the_worker_once_the_prefetch_finishes(
    make_manager: MakeManager,
) -> None:
    adapter = seeded_l2(KEYS[:2])
    m = make_manager([adapter])
    handle = m.submit_prefetch("r", [KEYS[:2]], 1, row_nbytes=[CHUNK])
    called = threading.Event()
    seen: list[tuple[str, int]] = []

    def done(h: PrefetchHandle) -> None:
        result = m.query_prefetch(h)  # the result is ready when the callback runs
        assert result is not None
        seen.append((threading.current_thread().name, result.hit_chunks))
        called.set()

    m.prefetch.add_done_callback(handle, done)
    assert adapter.get_entered.wait(10)
    assert not called.is_set()
    adapter.block_get.set()  # type: ignore[union-attr]
    assert called.wait(10)
    assert len(seen) == 1
    assert seen[0][0].startswith("kvmesh-prefetch")
    assert seen[0][1] == 2
    assert m.finish_read(KEYS[:2]) == [L1Result.SUCCESS] * 2


def test_a_done_callback_of_a_finished_prefetch_runs_at_once_then_not_found(
    make_manager: MakeManager,
) -> None:
    m = make_manager()
    handle = m.submit_prefetch("r", [KEYS[:1]], 1)  # L1 only: finished in submit
    calls: list[PrefetchHandle] = []
    m.prefetch.add_done_callback(handle, calls.append)
    assert calls == [handle]
    assert m.query_prefetch(handle) is not None
    with pytest.raises(NotFound):
        m.prefetch.add_done_callback(handle, calls.append)
    assert not m.prefetch.known(handle)


def test_a_failing_done_callback_is_logged_and_the_others_still_run(
    make_manager: MakeManager, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = seeded_l2(KEYS[:1])
    m = make_manager([adapter])
    handle = m.submit_prefetch("r", [KEYS[:1]], 1, row_nbytes=[CHUNK])
    second = threading.Event()

    def explode(h: PrefetchHandle) -> None:
        raise RuntimeError("callback exploded (test)")

    m.prefetch.add_done_callback(handle, explode)
    m.prefetch.add_done_callback(handle, lambda h: second.set())
    adapter.block_get.set()  # type: ignore[union-attr]
    assert second.wait(10)
    assert "done callback of prefetch r failed" in caplog.text
    result = m.query_prefetch(handle)
    assert result is not None
    assert result.hit_chunks == 1
    m.finish_read(result.locked_keys, result.num_kv_readers)


# -- the node ---------------------------------------------------------------------------


@pytest.fixture
def transfer(shm_dir: str) -> Iterator[TransferEngine]:
    engine = TransferEngine(shm_dir)
    yield engine
    engine.close()


def test_a_node_wait_holds_no_thread_and_ends_when_the_prefetch_does(
    make_manager: MakeManager, transfer: TransferEngine
) -> None:
    adapter = seeded_l2(KEYS[:1])
    node = StorageNode(make_manager([adapter]), transfer)

    async def scenario() -> tuple[bool, int, bool]:
        started = await node.lookup_and_lock("r", [KEYS[:1]], 1, 0, CHUNK)
        assert not started.completed
        before = set(threading.enumerate())
        waits = [
            asyncio.create_task(node.prefetch_status(started.prefetch_id, 60_000)) for _ in range(3)
        ]
        while node.waiting < 3:
            await asyncio.sleep(0)
        no_new_thread = set(threading.enumerate()) <= before
        adapter.block_get.set()  # type: ignore[union-attr]
        done = await asyncio.gather(*waits, return_exceptions=True)
        answers = [d for d in done if not isinstance(d, BaseException)]
        # One waiter receives the result; the others find it delivered.
        assert sum(1 for d in done if isinstance(d, NotFound)) == 2
        return no_new_thread, answers[0].hit_chunks, answers[0].completed

    no_new_thread, hits, completed = asyncio.run(scenario())
    assert no_new_thread
    assert (hits, completed) == (1, True)
    assert node.waiting == 0
    node.close()


def test_a_released_running_prefetch_gives_its_locks_back_when_it_finishes(
    make_manager: MakeManager, transfer: TransferEngine
) -> None:
    adapter = seeded_l2(KEYS[:2])
    m = make_manager([adapter])
    node = StorageNode(m, transfer)

    async def scenario() -> str:
        started = await node.lookup_and_lock("r", [KEYS[:2]], 1, 0, CHUNK)
        assert node.release_prefetch(started.prefetch_id)
        assert not node.release_prefetch(started.prefetch_id)
        return started.prefetch_id

    prefetch_id = asyncio.run(scenario())
    assert m.status()["prefetch"]["completed"] == 0
    adapter.block_get.set()  # type: ignore[union-attr]
    assert adapter.get_entered.wait(10)
    m.prefetch.close()  # joins the worker: its done callback has run
    assert m.status()["prefetch"]["l2_loaded_cells"] == 2
    assert m.status()["l1"]["read_locked_objects"] == 0
    with pytest.raises(NotFound):
        asyncio.run(node.prefetch_status(prefetch_id, 0))
    node.close()


def test_an_abandoned_l2_prefetch_expires_with_the_read_ttl(
    make_manager: MakeManager, transfer: TransferEngine, clock: FakeClock
) -> None:
    adapter = seeded_l2(KEYS[:1])
    m = make_manager([adapter])
    node = StorageNode(m, transfer, clock=clock)
    started = asyncio.run(node.lookup_and_lock("r", [KEYS[:1]], 1, 0, CHUNK))
    assert not started.completed
    adapter.block_get.set()  # type: ignore[union-attr]
    # It finishes; its caller never asks for the result.
    wait_until(lambda: m.status()["prefetch"]["unconsumed_results"] == 1)
    assert node.status()["active_prefetches"] == 1
    assert m.status()["l1"]["read_locked_objects"] == 1
    clock.advance(31)
    assert node.expire_transactions() == 0  # no engine-driven transaction expired
    assert node.status()["active_prefetches"] == 0
    assert m.status()["prefetch"]["expired_results"] == 1
    assert m.status()["l1"]["read_locked_objects"] == 0


def test_a_cancelled_copy_is_waited_for_before_the_caller_sees_the_cancellation(
    make_manager: MakeManager, transfer: TransferEngine
) -> None:
    copies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-copy")
    node = StorageNode(make_manager(), transfer, copy_executor=copies)
    entered = threading.Event()
    release = threading.Event()
    events: list[str] = []

    def copy() -> None:
        entered.set()
        assert release.wait(10)
        events.append("copy done")

    async def scenario() -> None:
        task = asyncio.create_task(node._copier.run(copy))
        while not entered.is_set():
            await asyncio.sleep(0)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()  # still waiting for the copy, not freeing its memory
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        events.append("caller cancelled")

    asyncio.run(scenario())
    assert events == ["copy done", "caller cancelled"]
    node.close()  # the executor is the caller's: still usable
    assert copies.submit(lambda: 1).result(10) == 1
    copies.shutdown()


def test_an_abandoned_prefetch_finishing_past_the_read_ttl_spares_newer_readers(
    make_manager: MakeManager, transfer: TransferEngine, clock: FakeClock
) -> None:
    # Its L1 hit was locked when it started; its L2 load outlasted the read TTL. The
    # lock lapsed and a new reader took the chunk: the abandoned prefetch's release
    # at its end must not take that reader's lock.
    adapter = seeded_l2(KEYS[1:2])
    m = make_manager([adapter])
    objs = m.reserve_write(KEYS[:1], CHUNK)
    assert set(objs) == {KEYS[0]}
    assert m.finish_write(KEYS[:1]) == [L1Result.SUCCESS]
    assert m.flush_l2_writes(10)  # the write-through's own read lock is gone
    node = StorageNode(m, transfer, clock=clock)
    started = asyncio.run(node.lookup_and_lock("r", [KEYS[:2]], 1, 0, CHUNK))
    assert not started.completed
    assert adapter.get_entered.wait(10)
    assert node.release_prefetch(started.prefetch_id)  # its caller went away
    clock.advance(31)  # the 30 s read TTL
    assert m.reserve_read(KEYS[:1], 1) == [L1Result.SUCCESS]
    adapter.block_get.set()  # type: ignore[union-attr]
    # Done, and its result taken by the abandonment's callback (which releases or drops).
    wait_until(lambda: m.status()["prefetch"]["completed"] == 1)
    wait_until(lambda: m.status()["prefetch"]["unconsumed_results"] == 0)
    assert m.l1.read_lock_count(KEYS[0]) == 1
    node.close()
