"""A load never waits behind stores for a copy thread.

An engine waits for a load before its next forward pass; a store runs after the
answer. With one pool of copy threads, stores that hold every thread (two long
prompts stored at once) made the next load wait for one of them to finish: the
copier runs loads on threads of their own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvmesh.common.node_types import StoreOutcome
from kvmesh.storage.core.copies import ChunkCopier
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.options import StorageOptions
from tests.unit.storage.helpers import MIB, FakeClock, make_key

CHUNK = 64 * 1024


class GatedTransfer:
    """The two calls the copier makes into the engine's memory: a gather waits for
    ``release`` (a store that holds its copy thread), a scatter records its chunks."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.gathering = threading.Semaphore(0)
        self.scattered: list[int] = []

    def gather_chunks(
        self,
        engine_id: str,
        blocks: object,
        tokens: object,
        outs: Sequence[torch.Tensor],
        *_: object,
    ) -> None:
        self.gathering.release()
        assert self.release.wait(30)
        for out in outs:
            out.fill_(ord("k"))

    def scatter_chunks(
        self,
        engine_id: str,
        blocks: object,
        tokens: object,
        srcs: Sequence[torch.Tensor],
        *_: object,
    ) -> None:
        self.scattered.append(len(srcs))


@pytest.fixture
def manager(shm_dir: str) -> Iterator[StorageManager]:
    options = StorageOptions(segment_bytes=4 * MIB, shm_dir=shm_dir, background_threads=False)
    manager = StorageManager("lanes", 8 * MIB, options=options, clock=FakeClock())
    yield manager
    manager.close()


def test_a_load_runs_while_stores_hold_every_copy_thread(manager: StorageManager) -> None:
    transfer = GatedTransfer()
    stores = ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-store")
    copier = ChunkCopier(manager, transfer, stores)  # type: ignore[arg-type]
    held = make_key(0)

    async def scenario() -> None:
        transfer.release.set()  # the first store (of the key loaded below) goes through
        assert await copier.store("e", [held], [[0]], 16, CHUNK) == [StoreOutcome.STORED]
        transfer.release.clear()
        # Two stores take both store threads and wait there.
        waiting = [
            asyncio.ensure_future(copier.store("e", [make_key(i)], [[i]], 16, CHUNK))
            for i in (1, 2)
        ]
        for _ in range(2):
            assert await asyncio.to_thread(transfer.gathering.acquire, True, 30)
        # The load does not wait for them (with one pool it would until the release).
        loaded = await asyncio.wait_for(
            copier.retrieve("e", [held], [[5]], 16, CHUNK, 0, [False]), timeout=20
        )
        assert loaded == 1
        assert transfer.scattered == [1]
        assert not any(store.done() for store in waiting)
        transfer.release.set()
        assert [await store for store in waiting] == [[StoreOutcome.STORED]] * 2

    try:
        asyncio.run(scenario())
    finally:
        transfer.release.set()
        copier.close()
        stores.shutdown(wait=True)


class ThreadCountingTransfer:
    """Records how many threads each copy may use (``copy_threads()`` on its thread)."""

    def __init__(self) -> None:
        self.gathers: list[int] = []
        self.scatters: list[int] = []

    def gather_chunks(self, *args: object) -> None:
        from kvmesh.kernels.parallel import copy_threads

        outs: Sequence[torch.Tensor] = args[3]  # type: ignore[assignment]
        self.gathers.append(copy_threads())
        for out in outs:
            out.fill_(ord("k"))

    def scatter_chunks(self, *_: object) -> None:
        from kvmesh.kernels.parallel import copy_threads

        self.scatters.append(copy_threads())


def _store_then_load(copier: ChunkCopier) -> None:
    """One store, then a load of it, with the process's copies set to two threads."""
    from kvmesh.kernels.parallel import set_copy_threads

    key = make_key(0)

    async def scenario() -> None:
        assert await copier.store("e", [key], [[0]], 16, CHUNK) == [StoreOutcome.STORED]
        assert await copier.retrieve("e", [key], [[5]], 16, CHUNK, 0, [False]) == 1

    set_copy_threads(2)
    try:
        asyncio.run(scenario())
    finally:
        set_copy_threads(None)
        copier.close()


@pytest.mark.parametrize(("store_threads", "expected"), [(1, 1), (None, 2)])
def test_a_store_copies_on_store_copy_threads_and_a_load_on_every_copy_thread(
    manager: StorageManager, store_threads: int | None, expected: int
) -> None:
    transfer = ThreadCountingTransfer()
    _store_then_load(ChunkCopier(manager, transfer, store_copy_threads=store_threads))  # type: ignore[arg-type]
    assert transfer.gathers == [expected]
    assert transfer.scatters == [2]  # loads are never capped: the engine waits for them


def test_a_load_after_a_store_on_the_same_copy_thread_is_not_capped(
    manager: StorageManager,
) -> None:
    transfer = ThreadCountingTransfer()
    one = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-one")  # stores and loads
    try:
        _store_then_load(ChunkCopier(manager, transfer, one, one))  # type: ignore[arg-type]
    finally:
        one.shutdown(wait=True)
    assert (transfer.gathers, transfer.scatters) == ([1], [2])


def test_store_copy_threads_below_one_are_refused(manager: StorageManager) -> None:
    with pytest.raises(ValueError, match="store_copy_threads"):
        ChunkCopier(manager, ThreadCountingTransfer(), store_copy_threads=0)  # type: ignore[arg-type]
