"""The connector's hooks follow LMCache's MP connector flow.

See docs/connector.md, "Scheduler flow" and "Worker flow".

Driven against :class:`FakeGateway`, an in-process gateway + storage, so the
tests see every call the connector makes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvmesh.connector import (
    ConnectorError,
    KVConnectorRole,
    KVMeshConnector,
    KVMeshConnectorConfig,
    Request,
    SchedulerOutput,
)
from kvmesh.connector.scheduler import LOOKUP_SPIN_S
from kvmesh.engine import SharedKVCache
from tests.support.fake_gateway import FakeGateway
from tests.support.waiting import wait_until

CHUNK, BLOCK = 256, 16


def _config(**overrides: object) -> KVMeshConnectorConfig:
    fields: dict[str, object] = {"gateway": "fake:0", "model_name": "m", "block_size": BLOCK}
    fields.update(overrides)
    return KVMeshConnectorConfig(**fields)  # type: ignore[arg-type]


def _request(n: int, rid: str = "r1", salt: str = "") -> Request:
    return Request(rid, list(range(1000, 1000 + n)), salt)


def _cache(gateway: FakeGateway, n_chunks: int, n_tokens: int, salt: str = "") -> None:
    tokens = list(range(1000, 1000 + n_tokens))
    for c in range(n_chunks):
        gateway.chunks[gateway._key("m", salt, tokens, c)] = []


def _scheduler(gateway: FakeGateway, **overrides: object) -> KVMeshConnector:
    return KVMeshConnector(_config(**overrides), KVConnectorRole.SCHEDULER, client=gateway)  # type: ignore[arg-type]


@pytest.fixture
def kv() -> Iterator[SharedKVCache]:
    with SharedKVCache(num_layers=2, num_blocks=80, block_size=BLOCK, kv_heads=1, head_dim=4) as c:
        yield c


@pytest.fixture
def worker(kv: SharedKVCache) -> Iterator[tuple[KVMeshConnector, FakeGateway]]:
    gateway = FakeGateway()
    conn = KVMeshConnector(_config(), KVConnectorRole.WORKER, client=gateway)  # type: ignore[arg-type]
    names = kv.named_layers()
    conn.register_kv_caches(names, dict(zip(names, kv.regions(), strict=True)))
    yield conn, gateway
    conn.shutdown()


# ------------------------------------------------------------------ scheduler


def test_lookup_is_sent_once_then_polled_until_it_completes() -> None:
    gateway = FakeGateway(pending_polls=2)
    _cache(gateway, 3, 1000)
    sched = _scheduler(gateway)
    request = _request(1000)

    answers = [sched.get_num_new_matched_tokens(request, 0) for _ in range(4)]

    assert answers == [(None, False), (None, False), (None, False), (768, True)]
    assert gateway.names().count("Lookup") == 1
    assert gateway.names().count("QueryPrefetchStatus") == 3
    lookup = gateway.requests("Lookup")[0]
    assert list(lookup.token_ids) == list(request.prompt_token_ids)
    assert (lookup.model_name, lookup.world_size, lookup.wait_timeout_ms) == ("m", 1, 0)


def test_the_scheduler_waits_for_lookups_holding_the_gil_and_for_nothing_else() -> None:
    gateway = FakeGateway()
    _scheduler(gateway)
    assert gateway.held_waits == {"Lookup": LOOKUP_SPIN_S}
    assert 0 < LOOKUP_SPIN_S <= 0.005  # under Python's switch interval


def test_a_full_hit_leaves_the_last_token_to_compute_rounded_down_to_a_block() -> None:
    gateway = FakeGateway()
    _cache(gateway, 4, 1024)
    sched = _scheduler(gateway)

    assert sched.get_num_new_matched_tokens(_request(1024), 0) == (1008, True)
    assert sched.lookup_result("r1").hit_tokens == 1024


def test_the_engines_own_prefix_hit_is_not_loaded_again() -> None:
    gateway = FakeGateway()
    _cache(gateway, 3, 1000)
    sched = _scheduler(gateway)

    assert sched.get_num_new_matched_tokens(_request(1000), 304) == (464, True)
    assert sched.get_num_new_matched_tokens(_request(1000), 768) == (0, False)


def test_a_prompt_without_a_complete_chunk_is_not_looked_up() -> None:
    gateway = FakeGateway()
    sched = _scheduler(gateway)

    assert sched.get_num_new_matched_tokens(_request(CHUNK - 1), 0) == (0, False)
    assert "Lookup" not in gateway.names()


@pytest.mark.parametrize("failing", ["GetChunkSize", "Lookup", "QueryPrefetchStatus"])
def test_a_gateway_error_means_recompute_not_wait(failing: str) -> None:
    gateway = FakeGateway(pending_polls=1, failing={failing})
    _cache(gateway, 2, 600)
    sched = _scheduler(gateway)
    request = _request(600)

    first = sched.get_num_new_matched_tokens(request, 0)
    if first == (None, False):  # only the poll fails
        first = sched.get_num_new_matched_tokens(request, 0)

    assert first == (0, False)
    calls = len(gateway.calls)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert len(gateway.calls) == calls  # decided once; no retry storm


def test_an_unreachable_gateway_is_asked_once_not_on_every_step() -> None:
    """The scheduler plans every step: with the gateway down it must not call it each time."""
    gateway = FakeGateway(failing={"GetChunkSize"})
    sched = _scheduler(gateway)
    request = _request(1000)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, list(range(1, 64)), 0)
    for n in (300, 400, 300, 1):
        assert not sched.build_connector_meta(SchedulerOutput({"r1": n}))
    assert gateway.names().count("GetChunkSize") == 1
    assert sched.gateway_down()


def test_a_lookup_unfinished_by_its_deadline_counts_as_a_miss() -> None:
    gateway = FakeGateway(pending_polls=1_000_000)
    _cache(gateway, 2, 600)
    sched = _scheduler(gateway, lookup_timeout_s=0.0)

    assert sched.get_num_new_matched_tokens(_request(600), 0) == (0, False)


def test_locks_of_chunks_that_will_not_be_retrieved_are_freed() -> None:
    gateway = FakeGateway()
    _cache(gateway, 3, 1000)
    _cache(gateway, 2, 1000, salt="s")
    sched = _scheduler(gateway)
    loads, skips = _request(1000, "load"), _request(1000, "skip", salt="s")

    need, _ = sched.get_num_new_matched_tokens(loads, 600)
    sched.update_state_after_alloc(loads, list(range(1, 64)), need or 0)
    # kvmesh holds 2 chunks, the engine's own cache 640 tokens: nothing to load.
    assert sched.get_num_new_matched_tokens(skips, 640) == (0, False)
    sched.update_state_after_alloc(skips, list(range(1, 64)), 0)
    sched.flush_releases()  # the frees are sent from the releases' thread

    freed = {
        r.request_id: (r.start_token, r.end_token) for r in gateway.requests("FreeLookupLocks")
    }
    # A retrieve starts at the chunk holding token 600: chunks [0, 512) are not retrieved.
    # Without a retrieve, every locked chunk is freed.
    assert freed == {"load": (0, 512), "skip": (0, 512)}


def test_a_prompt_whose_every_chunk_the_engine_holds_is_neither_looked_up_nor_stored() -> None:
    gateway = FakeGateway()
    _cache(gateway, 3, 1000)
    sched = _scheduler(gateway)
    request = _request(1000)  # complete chunks: [0, 768)

    assert sched.get_num_new_matched_tokens(request, 768) == (0, False)
    sched.update_state_after_alloc(request, list(range(1, 64)), 0)
    meta = sched.build_connector_meta(SchedulerOutput({"r1": 1000 - 768}))

    assert "Lookup" not in gateway.names()
    assert not meta.retrieve_ops
    assert not meta.store_ops


def test_a_resumed_request_with_less_of_its_prefix_in_the_engine_is_looked_up() -> None:
    gateway = FakeGateway()
    _cache(gateway, 1, 1000)  # kvmesh holds the first chunk only
    sched = _scheduler(gateway)
    request = _request(1000)
    assert sched.get_num_new_matched_tokens(request, 768) == (0, False)

    # Preempted, then resumed after the engine evicted its whole prefix.
    need, load_async = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, list(range(1, 64)), need or 0)
    meta = sched.build_connector_meta(SchedulerOutput({"r1": 1000 - 256}))

    assert [r.request_id for r in gateway.requests("Lookup")] == ["r1"]
    assert (need, load_async) == (256, True)
    # What the engine held before no longer counts: the chunks it lost are stored.
    assert [(op.start, op.end) for op in meta.store_ops] == [(256, 768)]


def test_a_prompt_with_one_complete_chunk_beyond_the_engines_hit_is_looked_up() -> None:
    gateway = FakeGateway()
    _cache(gateway, 3, 1000)
    sched = _scheduler(gateway)

    need, _ = sched.get_num_new_matched_tokens(_request(1000), 752)  # 768 is a chunk's end

    assert gateway.names().count("Lookup") == 1
    assert need == 768 - 752


def test_freeing_locks_does_not_hold_the_scheduler_and_comes_before_the_session_end() -> None:
    gateway = FakeGateway(end_session_gate=threading.Event())
    _cache(gateway, 2, 1000)  # the engine's own cache holds more (640 tokens)
    sched = _scheduler(gateway)
    first, second = _request(1000, "r1"), _request(1000, "r2")
    sched.get_num_new_matched_tokens(first, 640)
    sched.update_state_after_alloc(first, list(range(1, 64)), 0)
    sched.request_finished(first)  # its EndSession is held by the gateway
    sched.get_num_new_matched_tokens(second, 640)
    sched.update_state_after_alloc(second, list(range(1, 64)), 0)
    # r1's free is sent; r2's waits behind r1's held EndSession, and the scheduler went on.
    wait_until(lambda: gateway.requests("FreeLookupLocks"), 10)
    assert [r.request_id for r in gateway.requests("FreeLookupLocks")] == ["r1"]

    gateway.end_session_gate.set()  # type: ignore[union-attr]
    sched.flush_releases()
    order = [(n, r.request_id) for n, r in gateway.calls if n in ("FreeLookupLocks", "EndSession")]
    assert order == [("FreeLookupLocks", "r1"), ("EndSession", "r1"), ("FreeLookupLocks", "r2")]


def test_retrieve_op_starts_on_a_chunk_and_skips_the_engines_own_prefix() -> None:
    gateway = FakeGateway()
    _cache(gateway, 3, 1100)
    sched = _scheduler(gateway)
    request = _request(1100)
    blocks = list(range(1, 70))

    need, _ = sched.get_num_new_matched_tokens(request, 304)
    assert need == 464
    sched.update_state_after_alloc(request, blocks, need)
    meta = sched.build_connector_meta(SchedulerOutput({"r1": 1100 - 768}))

    (op,) = meta.retrieve_ops
    assert (op.start, op.end, op.skip_first_n_tokens) == (256, 768, 48)
    assert list(op.block_ids) == blocks[16:48]
    assert list(op.token_ids) == list(request.prompt_token_ids[:768])
    # Newly computed complete chunks are stored; what kvmesh already has is not.
    (store,) = meta.store_ops
    assert (store.start, store.end) == (768, 1024)
    assert list(store.block_ids) == blocks[48:64]
    # The retrieve is emitted once.
    assert not sched.build_connector_meta(SchedulerOutput({"r1": 1})).retrieve_ops


def test_store_ops_follow_chunked_prefill_step_by_step() -> None:
    gateway = FakeGateway()
    sched = _scheduler(gateway)
    request = _request(1000)
    blocks = list(range(1, 64))
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, blocks, 0)

    steps = [sched.build_connector_meta(SchedulerOutput({"r1": n})) for n in (300, 400, 300, 1)]

    ranges = [[(op.start, op.end) for op in meta.store_ops] for meta in steps]
    # Only prompt chunks, never the partial tail or decode tokens.
    assert ranges == [[(0, 256)], [(256, 512)], [(512, 768)], []]


def test_store_after_prefill_stores_the_whole_prompt_in_the_step_that_finishes_it() -> None:
    gateway = FakeGateway()
    sched = _scheduler(gateway, store_after_prefill=True)
    request = _request(1000)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, list(range(1, 64)), 0)

    steps = [sched.build_connector_meta(SchedulerOutput({"r1": n})) for n in (300, 400, 300, 1)]

    ranges = [[(op.start, op.end) for op in meta.store_ops] for meta in steps]
    assert ranges == [[], [], [(0, 768)], []]
    (op,) = steps[2].store_ops
    assert op.block_ids == list(range(1, 1 + 768 // BLOCK))


def test_request_finished_ends_the_session_and_holds_blocks_while_stores_run() -> None:
    gateway = FakeGateway()
    sched = _scheduler(gateway)
    stored, unstored = _request(600, "stored"), _request(100, "unstored")
    for request in (stored, unstored):
        sched.get_num_new_matched_tokens(request, 0)
        sched.update_state_after_alloc(request, list(range(1, 40)), 0)
        sched.build_connector_meta(SchedulerOutput({request.request_id: request.num_prompt_tokens}))

    assert sched.request_finished(stored) is True
    assert sched.request_finished(unstored) is False
    sched.flush_releases()
    assert [r.request_id for r in gateway.requests("EndSession")] == ["stored", "unstored"]


def test_request_finished_does_not_wait_for_end_session_but_a_new_lookup_of_its_id_does() -> None:
    gateway = FakeGateway(end_session_gate=threading.Event())
    sched = _scheduler(gateway)
    first = _request(600, "r1")
    sched.get_num_new_matched_tokens(first, 0)

    assert sched.request_finished(first) is False  # returns while EndSession is held
    assert gateway.requests("EndSession") == []
    other = _request(600, "r2")
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)  # another id: no wait

    again = _request(600, "r1")
    asked = threading.Thread(target=sched.get_num_new_matched_tokens, args=(again, 0))
    asked.start()
    asked.join(0.3)
    assert asked.is_alive()  # held until r1's session has ended
    gateway.end_session_gate.set()  # type: ignore[union-attr]
    asked.join(10)
    assert not asked.is_alive()
    order = [(n, r.request_id) for n, r in gateway.calls if n in ("Lookup", "EndSession")]
    assert order == [("Lookup", "r1"), ("Lookup", "r2"), ("EndSession", "r1"), ("Lookup", "r1")]


def test_request_finished_survives_a_gateway_error() -> None:
    gateway = FakeGateway(failing={"EndSession"})
    sched = _scheduler(gateway)

    assert sched.request_finished(_request(10)) is False


def test_hooks_of_the_other_role_are_refused() -> None:
    sched = _scheduler(FakeGateway())
    with pytest.raises(RuntimeError, match="worker-side"):
        sched.register_kv_caches({}, {})


# --------------------------------------------------------------------- worker


def test_register_sends_one_shared_memory_handle_per_layer(
    worker: tuple[KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    _, gateway = worker
    (request,) = gateway.requests("RegisterKVCache")
    layout = request.layout
    assert (layout.kind, layout.num_layers, layout.num_blocks, layout.block_size) == (1, 2, 80, 16)
    assert (layout.kv_heads, layout.head_dim, layout.dtype) == (1, 4, 3)
    handles = [h.shared_memory for h in request.layers]
    assert [(h.path, h.offset_bytes, h.size_bytes) for h in handles] == [
        (kv.path, i * kv.layer_bytes, kv.layer_bytes) for i in range(2)
    ]


def test_register_refuses_a_region_that_is_not_the_layers_size(kv: SharedKVCache) -> None:
    conn = KVMeshConnector(_config(), KVConnectorRole.WORKER, client=FakeGateway())  # type: ignore[arg-type]
    names = kv.named_layers()
    regions = dict(zip(names, kv.regions(), strict=True))
    first = next(iter(names))
    regions[first] = type(regions[first])(kv.path, 0, kv.layer_bytes - 4)
    with pytest.raises(ConnectorError, match="region"):
        conn.register_kv_caches(names, regions)


def test_the_registration_has_its_own_deadline_and_requests_keep_theirs(
    kv: SharedKVCache,
) -> None:
    """A node maps the KV memory (and may load torch) for a registration: seconds on a
    loaded host, more than the per-request deadline allows."""
    gateway = FakeGateway()
    config = _config(rpc_timeout_s=0.5, register_timeout_s=30.0)
    conn = KVMeshConnector(config, KVConnectorRole.WORKER, client=gateway)  # type: ignore[arg-type]
    try:
        names = kv.named_layers()
        conn.register_kv_caches(names, dict(zip(names, kv.regions(), strict=True)))
        _store_then_load(conn, kv, 2 * CHUNK, list(range(40, 72)))
    finally:
        conn.shutdown()
    assert gateway.deadlines[0] == ("RegisterKVCache", 30.0)
    assert {name for name, _ in gateway.deadlines[1:]} == {"Store", "Retrieve"}
    assert {deadline for _, deadline in gateway.deadlines[1:]} == {0.5}


def _store_then_load(
    conn: KVMeshConnector, kv: SharedKVCache, n_tokens: int, load_blocks: list[int]
) -> set[str]:
    sched = _scheduler(conn.client)  # type: ignore[arg-type]
    request = _request(n_tokens)
    stored_blocks = list(range(1, 1 + n_tokens // BLOCK))
    for layer in kv.layers:
        layer[:, stored_blocks] = torch.randn(2, len(stored_blocks), BLOCK, 1, 4)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, stored_blocks, 0)
    conn.save_kv(sched.build_connector_meta(SchedulerOutput({"r1": n_tokens})))
    assert conn.wait_for_save() == set()
    sched.request_finished(request)

    again = _request(n_tokens, "r2")
    need, _ = sched.get_num_new_matched_tokens(again, 0)
    sched.update_state_after_alloc(again, load_blocks, need or 0)
    conn.start_load_kv(sched.build_connector_meta(SchedulerOutput({"r2": 16})))
    return conn.wait_for_load()


def test_load_copies_stored_chunks_into_the_new_blocks(
    worker: tuple[KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    conn, _ = worker
    load_blocks = list(range(40, 72))

    assert _store_then_load(conn, kv, 512, load_blocks) == set()
    for layer in kv.layers:
        assert torch.equal(layer[:, load_blocks[:31]], layer[:, 1:32])
    assert conn.get_block_ids_with_load_errors() == set()


def test_a_short_load_reports_the_request_and_the_blocks_left_unfilled(
    worker: tuple[KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    conn, gateway = worker
    gateway.retrieve_limit = 1
    load_blocks = list(range(40, 72))

    assert _store_then_load(conn, kv, 512, load_blocks) == {"r2"}
    assert conn.get_block_ids_with_load_errors() == set(load_blocks[16:])
    assert conn.get_block_ids_with_load_errors() == set()


def test_a_failed_load_reports_every_block(
    worker: tuple[KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    conn, gateway = worker
    gateway.failing.add("Retrieve")
    load_blocks = list(range(40, 72))

    assert _store_then_load(conn, kv, 512, load_blocks) == {"r2"}
    assert conn.get_block_ids_with_load_errors() == set(load_blocks)


def test_a_gateway_that_forgot_the_engine_gets_it_registered_again_in_the_background(
    worker: tuple[KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    conn, gateway = worker
    gateway.forget_engine = 1
    sched = _scheduler(gateway)
    request = _request(512)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, list(range(1, 33)), 0)

    # The store that finds the engine unknown fails at once (a future miss); the
    # registration runs on the heartbeat thread, never inside the engine's step.
    conn.save_kv(sched.build_connector_meta(SchedulerOutput({"r1": 512})))
    assert conn.wait_for_save() == {"r1"}
    wait_until(lambda: conn.registered, 10)

    assert _store_then_load(conn, kv, 512, list(range(40, 72))) == set()
    assert gateway.names().count("RegisterKVCache") == 2
    assert len(gateway.chunks) == 2


def test_shutdown_unregisters_the_kv_memory(kv: SharedKVCache) -> None:
    gateway = FakeGateway()
    conn = KVMeshConnector(_config(), KVConnectorRole.WORKER, client=gateway)  # type: ignore[arg-type]
    names = kv.named_layers()
    conn.register_kv_caches(names, dict(zip(names, kv.regions(), strict=True)))
    conn.shutdown()

    assert [r.engine_id for r in gateway.requests("UnregisterKVCache")] == [conn.engine_id]
    assert not gateway.registered


def test_a_whole_load_runs_on_the_callers_thread_and_the_steps_others_beside_it(
    worker: tuple[KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    """The caller waits for whole loads next anyway, so the first skips the hand-off to a
    transfer thread; a second load of the step runs on one, side by side with it."""
    conn, gateway = worker
    threads: list[str] = []
    retrieve = gateway.retrieve

    def recording(request: object, **kwargs: object) -> object:
        threads.append(threading.current_thread().name)
        return retrieve(request, **kwargs)

    gateway.retrieve = recording  # type: ignore[method-assign]
    load_blocks = list(range(40, 72))
    assert _store_then_load(conn, kv, 512, load_blocks) == set()
    assert threads == [threading.current_thread().name]
    for layer in kv.layers:
        assert torch.equal(layer[:, load_blocks[:31]], layer[:, 1:32])

    threads.clear()
    sched = _scheduler(gateway)
    for rid, blocks in (("a", list(range(40, 72))), ("b", list(range(8, 40)))):
        request = _request(512, rid)
        need, _ = sched.get_num_new_matched_tokens(request, 0)
        sched.update_state_after_alloc(request, blocks, need or 0)
    conn.start_load_kv(sched.build_connector_meta(SchedulerOutput({"a": 16, "b": 16})))
    assert conn.wait_for_load() == set()
    assert len(threads) == 2
    assert threading.current_thread().name in threads
    assert any(name.startswith("kvmesh-transfer") for name in threads)
