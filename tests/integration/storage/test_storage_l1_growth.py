"""L1 grows without anyone waiting: lookups are answered while a segment is populated.

Populating a new 256 MiB segment takes tens of milliseconds of kernel time.
It runs with the GIL released (ctypes, not ``mmap.madvise``) and off the
event loop (the background grower's thread, or a worker thread when a store
needs room at once), so the node's loop answers lookups meanwhile. Each test
counts the lookups a real client completed inside the populate's window
(about 0.1 s for 512 MiB here; 10-30 lookups fit in it, 7-10 ms each while
the populate takes a core and the memory bus). A populate holding the GIL
or the loop lets through at most the one lookup that was finishing as it
started, so two are the line.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import kvmesh.storage.core.l1.pool as pool_module
from kvmesh.api.storage.v1 import storage_pb2
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.support import (
    CHUNK_BYTES,
    Engine,
    Node,
    chunk_blocks,
    grid,
    new_hashes,
)
from tests.support.waiting import wait_until

MIB = 1 << 20
SEGMENT = 512 * MIB  # about 0.1 s to populate here: room for many lookups


def _watch_growth(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """Record the (start, end) of every populate of a new segment from now on."""
    windows: list[tuple[float, float]] = []
    original = pool_module._prefault

    def timed(mapping: Any) -> None:
        start = time.perf_counter()
        try:
            original(mapping)
        finally:
            windows.append((start, time.perf_counter()))

    monkeypatch.setattr(pool_module, "_prefault", timed)
    return windows


def _lookups_during(node: Node, grow: Any, windows: list[tuple[float, float]]) -> list[float]:
    """Run ``grow()`` on its own thread while looking up; the lookups' end times."""
    done: list[float] = []
    stop = threading.Event()

    async def lookups() -> None:
        request = storage_pb2.LookupAndLockRequest(
            keys=grid([b"\x01" * 32]), wait_timeout_ms=1000, request_id="growth"
        )
        while not stop.is_set():
            await node.client.lookup_and_lock(request)
            done.append(time.perf_counter())

    grower = threading.Thread(target=lambda: (grow(), stop.set()))
    future = asyncio.run_coroutine_threadsafe(lookups(), node.thread.loop)
    # The client's channel is up and lookups flow before the growth starts.
    deadline = time.monotonic() + 30
    while len(done) < 3 and not future.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    grower.start()
    grower.join(60)
    stop.set()
    future.result(60)
    assert windows, "no segment was mapped"
    return done


def test_lookups_are_answered_while_the_background_grower_populates_a_segment(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(l1_size_bytes=2 * SEGMENT, l1_segment_bytes=SEGMENT)
    pool = node.app.manager.pool
    windows = _watch_growth(monkeypatch)
    committed = pool.committed_bytes

    def grow() -> None:
        pool.request_growth()
        assert pool.wait_committed(committed + SEGMENT, timeout=30)

    done = _lookups_during(node, grow, windows)
    start, end = windows[0]
    inside = [t for t in done if start < t < end]
    assert len(inside) >= 2, (
        f"{len(inside)} lookups answered during a {1e3 * (end - start):.0f} ms growth"
    )


def test_a_store_that_needs_room_grows_off_the_event_loop(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(l1_size_bytes=2 * SEGMENT, l1_segment_bytes=SEGMENT)
    manager = node.app.manager
    pool = manager.pool
    windows = _watch_growth(monkeypatch)
    # Everything committed is taken: the next reservation needs a new segment.
    taken = pool.allocate(pool.segment_bytes)
    assert taken is not None

    call: list[float] = []

    async def store_needing_room() -> None:
        call.append(time.monotonic())
        await manager.make_room([4 * MIB])
        call.append(time.monotonic())

    done = _lookups_during(
        node,
        lambda: asyncio.run_coroutine_threadsafe(store_needing_room(), node.thread.loop).result(60),
        windows,
    )
    start, end = windows[0]
    inside = [t for t in done if start < t < end]
    assert len(inside) >= 2, (
        f"{len(inside)} lookups answered during a {1e3 * (end - start):.0f} ms growth"
    )
    assert pool.would_fit([4 * MIB])
    # The store's wait is measured and exported (what ``kvmesh bench serve`` reports).
    assert manager.growth_waits == 1
    # The wait recorded is the store's own: inside the call that made room
    # (the call's span, not a time limit; the populate itself may queue behind
    # the background grower on a loaded host).
    assert 0 < manager.growth_wait_max_s <= call[1] - call[0]
    assert manager.status()["l1"]["growth_wait_max_s"] == manager.growth_wait_max_s
    pool.free(taken)


def test_a_reservation_on_the_event_loop_never_maps_memory(make_node: NodeFactory) -> None:
    """Without make_room first, the loop leaves the growth to the grower (no stall)."""
    node = make_node(l1_size_bytes=2 * SEGMENT, l1_segment_bytes=SEGMENT)
    manager = node.app.manager
    pool = manager.pool
    taken = pool.allocate(pool.segment_bytes)
    assert taken is not None
    mapped_on: list[str] = []
    original = pool._map_segment

    def spy(*args: Any) -> Any:
        mapped_on.append(threading.current_thread().name)
        return original(*args)

    pool._map_segment = spy  # type: ignore[method-assign]

    async def reserve() -> bool:
        from kvmesh.common.keys import ObjectKey

        key = ObjectKey(b"\x02" * 32, "m", 0)
        reserved = manager.reserve_write([key], 4 * MIB)
        return key in reserved

    got = asyncio.run_coroutine_threadsafe(reserve(), node.thread.loop).result(60)
    assert got is False  # out of memory for now, not a stalled loop
    assert manager.loop_growths_deferred == 1
    assert pool.wait_committed(2 * SEGMENT, timeout=30)  # the grower added the segment
    assert mapped_on
    assert all(name != node.thread._thread.name for name in mapped_on), mapped_on
    pool.free(taken)


def test_stores_larger_than_half_a_segment_never_wait_for_a_growth(
    make_node: NodeFactory, engine: Engine
) -> None:
    """One long prompt of a real model is most of a segment (8 000 tokens of SmolLM2
    are 174 of 256 MiB): the grower keeps a whole such store free ahead, so with
    time between stores (a prefill's worth) none waits for L1 to grow."""
    page = CHUNK_BYTES  # one 4 KiB page of L1 a chunk
    chunks = 28  # 112 KiB a store: 70 % of a 160 KiB segment
    node = make_node(l1_size_bytes=1024 * 1024, l1_segment_bytes=40 * page)
    node.register(engine)
    manager = node.app.manager
    pool = manager.pool
    blocks = [b for c in range(chunks) for b in chunk_blocks(c)]
    for _ in range(4):
        assert node.store(engine, new_hashes(chunks), blocks) == [1] * chunks
        # The grower's time between stores: it leaves a whole store free. With
        # half a segment of headroom only, 96 KiB would stay free after the
        # second store and the third would wait for a growth.
        wait_until(lambda: pool.free_bytes >= chunks * page, timeout=10)
    assert manager.growth_waits == 0
    assert pool.used_bytes == 4 * chunks * page
