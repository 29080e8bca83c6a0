"""Waits for a prefetch park no thread, so they never hold up the data path.

gateway.proto promises that "the wait never blocks other RPCs". These tests
park more waits than the node has copy threads (``GetPrefetchStatus`` and
``LookupAndLock`` with a wait), behind a memory L2 whose injected latency is
long. Then they check that a one-chunk Store and a Retrieve finish while
every wait is still parked. They assert the order of events, never a
duration: the latency ends when the test releases it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.storage.core.l2 import memory as memory_l2
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.support import Engine, Node, chunk_blocks, grid, new_hashes
from tests.support.waiting import wait_until

STORED = storage_pb2.STORE_OUTCOME_STORED
LONG_LATENCY_S = 3600.0  # never reached: the test releases the latency first
WAIT_MS = 120_000  # longer than any test: a wait ends because its prefetch finished


class ReleasableLatency:
    """Stands in for ``time`` in the memory L2 module: its latency sleeps until released."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.released.wait(seconds)


@pytest.fixture
def latency(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReleasableLatency]:
    gate = ReleasableLatency()
    monkeypatch.setattr(memory_l2, "time", gate)
    try:
        yield gate
    finally:
        gate.released.set()  # also when the test fails: the node must be able to stop


def slow_l2_node(make_node: NodeFactory, engine: Engine) -> tuple[Node, list[bytes]]:
    """A node whose memory L2 holds copy-threads + 2 one-chunk keys that are not in L1.

    Its L2 latency is then made long: every lookup of those keys stays running.
    """
    node = make_node(l2=['{"type": "memory"}'])
    node.register(engine)
    n_keys = node.app.copy_threads + 2
    hashes = new_hashes(n_keys)
    blocks = [b for c in range(n_keys) for b in chunk_blocks(c)]
    assert node.store(engine, hashes, blocks) == [STORED] * n_keys
    wait_until(lambda: node.l2_hashes() == set(hashes))
    node.call("clear", storage_pb2.ClearRequest(force=True))
    assert not node.l1_hashes()
    memory_adapter(node).latency_s = LONG_LATENCY_S
    return node, hashes


def memory_adapter(node: Node) -> memory_l2.MemoryL2Adapter:
    adapter = node.app.manager.tiers[0].adapter
    assert isinstance(adapter, memory_l2.MemoryL2Adapter)
    return adapter


def start_call(node: Node, method: str, request: Any) -> Future[Any]:
    """Start a client call on the server thread's loop without waiting for it."""
    return asyncio.run_coroutine_threadsafe(getattr(node.client, method)(request), node.thread.loop)


def waiting(node: Node) -> int:
    return int(node.app.node.status()["waiting_calls"])


def threads_but_prefetch_workers() -> set[threading.Thread]:
    """This process's threads (the node runs in it), less the L2 prefetch workers."""
    return {t for t in threading.enumerate() if not t.name.startswith("kvmesh-prefetch")}


def assert_the_data_path_runs(node: Node, engine: Engine, base_chunk: int) -> None:
    """A one-chunk Store, then a Retrieve of it into other blocks, both complete."""
    fresh = new_hashes(1)
    assert node.store(engine, fresh, chunk_blocks(base_chunk)) == [STORED]
    target = chunk_blocks(base_chunk + 1)
    engine.fill(target, 0.0)
    assert node.retrieve(engine, fresh, target) == 1
    assert engine.blocks_bytes(target) == engine.blocks_bytes(chunk_blocks(base_chunk))


def test_parked_prefetch_waits_never_hold_up_a_store_or_a_retrieve(
    make_node: NodeFactory, engine: Engine, latency: ReleasableLatency
) -> None:
    node, hashes = slow_l2_node(make_node, engine)
    n_waits = len(hashes)
    threads_before = threads_but_prefetch_workers()

    prefetch_ids = []
    for h in hashes:
        started = node.lookup([h], wait_ms=0)
        assert not started.completed  # its L2 lookup sleeps in the injected latency
        prefetch_ids.append(started.prefetch_id)
    waits = [
        start_call(
            node,
            "get_prefetch_status",
            storage_pb2.GetPrefetchStatusRequest(prefetch_id=pid, wait_timeout_ms=WAIT_MS),
        )
        for pid in prefetch_ids
    ]
    wait_until(lambda: waiting(node) == n_waits)
    # Parked, they hold no thread: no thread but the prefetches' own workers started.
    assert threads_but_prefetch_workers() <= threads_before

    assert_the_data_path_runs(node, engine, base_chunk=n_waits)
    # Only now: every wait is still parked (the store and retrieve did not queue behind them).
    assert not any(w.done() for w in waits)
    assert waiting(node) == n_waits

    memory_adapter(node).latency_s = 0.0
    latency.released.set()
    for w in waits:
        answer = w.result(timeout=60)
        assert answer.completed
        assert (answer.result.hit_chunks, answer.result.l2_hit_chunks) == (1, 1)
    assert waiting(node) == 0
    assert node.status().active_prefetches == 0
    # Each delivered prefetch left one read lock per key with the caller.
    counts = node.call("release_locks", storage_pb2.ReleaseLocksRequest(keys=grid(hashes)))
    assert (counts.released_keys, counts.skipped_keys) == (n_waits, 0)
    # The L2 write-through of the data path's stores holds its batch's read locks
    # until its writes return (at a lower thread priority): wait for it too.
    wait_until(lambda: node.read_locked_objects() == 0)


def test_lookups_waiting_then_abandoned_give_their_locks_back_when_the_loads_finish(
    make_node: NodeFactory, engine: Engine, latency: ReleasableLatency
) -> None:
    node, hashes = slow_l2_node(make_node, engine)
    n_waits = len(hashes)
    threads_before = threads_but_prefetch_workers()

    lookups = [
        start_call(
            node,
            "lookup_and_lock",
            storage_pb2.LookupAndLockRequest(
                keys=grid([h]), wait_timeout_ms=WAIT_MS, request_id=f"abandoned-{i}"
            ),
        )
        for i, h in enumerate(hashes)
    ]
    wait_until(lambda: waiting(node) == n_waits)
    assert threads_but_prefetch_workers() <= threads_before
    assert_the_data_path_runs(node, engine, base_chunk=n_waits)
    assert not any(lookup.done() for lookup in lookups)

    # The callers go away: they never learned their prefetch ids, so the node
    # must give the locks back itself once each load finishes.
    for lookup in lookups:
        lookup.cancel()
    wait_until(lambda: waiting(node) == 0 and node.status().active_prefetches == 0)

    memory_adapter(node).latency_s = 0.0
    latency.released.set()
    prefetch = node.app.manager.prefetch
    wait_until(lambda: prefetch.stats()["completed"] >= n_waits)
    assert prefetch.stats()["l2_loaded_cells"] == n_waits  # it loaded, then gave them back
    wait_until(lambda: node.read_locked_objects() == 0 and not (node.l1_hashes() & set(hashes)))


def test_the_copy_threads_setting_sizes_the_store_and_the_load_executors(
    make_node: NodeFactory,
) -> None:
    node = make_node(copy_threads=3)
    assert node.app.copy_threads == 3
    assert node.app.copy_executor._max_workers == 3
    assert node.app.load_executor._max_workers == 3


@pytest.mark.parametrize(("setting", "cap"), [(None, 1), (0, None), (2, 2)])
def test_the_store_copy_threads_setting_caps_each_store_copy(
    make_node: NodeFactory, setting: int | None, cap: int | None
) -> None:
    node = make_node() if setting is None else make_node(store_copy_threads=setting)
    assert node.app.node._copier.store_copy_threads == cap  # None: as many as a load's
