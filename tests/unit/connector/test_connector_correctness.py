"""What the connector must never do: store KV that was computed over blocks no load
filled, lose a load vLLM counts as done, or serve KV from before a cache reset.

Against :class:`FakeGateway` (an in-process gateway + storage) and the shared KV
cache of :mod:`kvmesh.engine`, driving the hooks in the order vLLM calls them.
"""

from __future__ import annotations

import pytest

from kvmesh.connector import KVConnectorRole, KVMeshConnector, SchedulerOutput
from kvmesh.engine import SharedKVCache
from tests.support.fake_gateway import FakeGateway
from tests.support.waiting import wait_until
from tests.unit.connector.test_connector import _cache, _request, _scheduler
from tests.unit.connector.test_connector_serving import _worker, kv  # noqa: F401 (fixture)


def _stored_requests(gateway: FakeGateway) -> list[str]:
    return [req.range.request_id for req in gateway.requests("Store")]


@pytest.mark.parametrize("fault", ["fails", "falls short"])
def test_a_step_whose_load_fell_short_stores_nothing_of_that_request(
    kv: SharedKVCache,  # noqa: F811
    fault: str,
) -> None:
    gateway = FakeGateway()
    if fault == "fails":
        gateway.failing_retrieves.add(0)
    else:
        gateway.retrieve_limit = 1
    _cache(gateway, 2, 768)  # r1's first 512 tokens
    conn = _worker(gateway, kv)
    sched = _scheduler(gateway)
    hit, other = _request(768, "r1"), _request(256, "r2", salt="other")
    try:
        need, _ = sched.get_num_new_matched_tokens(hit, 0)
        assert need == 512
        sched.update_state_after_alloc(hit, list(range(48)), need)
        sched.get_num_new_matched_tokens(other, 0)
        sched.update_state_after_alloc(other, list(range(48, 64)), 0)
        # One step loads r1's 512 tokens, computes its other 256 and all of r2.
        meta = sched.build_connector_meta(SchedulerOutput({"r1": 256, "r2": 256}))
        assert {op.request_id for op in meta.store_ops} == {"r1", "r2"}

        conn.start_load_kv(meta)
        assert conn.wait_for_load() == {"r1"}
        conn.save_kv(meta)
        assert conn.wait_for_save() == set()
        # r1's tokens 512-767 were computed over blocks the load did not fill.
        assert _stored_requests(gateway) == ["r2"]
        assert conn.get_block_ids_with_load_errors()
    finally:
        conn.shutdown()


def test_a_failed_load_does_not_keep_later_steps_from_storing(
    kv: SharedKVCache,  # noqa: F811
) -> None:
    gateway = FakeGateway()
    gateway.failing_retrieves.add(0)
    _cache(gateway, 2, 768)
    conn = _worker(gateway, kv)
    sched = _scheduler(gateway)
    try:
        first = _request(768, "r1")
        need, _ = sched.get_num_new_matched_tokens(first, 0)
        sched.update_state_after_alloc(first, list(range(48)), need or 0)
        meta = sched.build_connector_meta(SchedulerOutput({"r1": 256}))
        conn.start_load_kv(meta)
        conn.wait_for_load()
        conn.save_kv(meta)
        conn.wait_for_save()

        later = _request(256, "r2", salt="other")
        sched.get_num_new_matched_tokens(later, 0)
        sched.update_state_after_alloc(later, list(range(48, 64)), 0)
        meta = sched.build_connector_meta(SchedulerOutput({"r2": 256}))
        conn.start_load_kv(meta)
        conn.wait_for_load()
        conn.save_kv(meta)
        assert conn.wait_for_save() == set()
        assert _stored_requests(gateway) == ["r2"]
    finally:
        conn.shutdown()


def test_stores_follow_the_engines_count_when_a_failed_load_moves_it_back() -> None:
    gateway = FakeGateway()
    _cache(gateway, 2, 2048)
    sched = _scheduler(gateway)
    request = _request(2048)
    need, _ = sched.get_num_new_matched_tokens(request, 0)
    assert need == 512
    sched.update_state_after_alloc(request, list(range(128)), need)
    # Step 1 loads 512 tokens and computes 512-1535 (its store of them is dropped by the
    # worker when the load fails); vLLM then moves the request back to its first
    # unloaded block (token 0) and computes it again.
    step = sched.build_connector_meta(
        SchedulerOutput({"r1": 1024}, num_computed_tokens={"r1": 512})
    )
    assert len(step.retrieve_ops) == 1
    assert [(op.start, op.end) for op in step.store_ops] == [(512, 1536)]
    step = sched.build_connector_meta(SchedulerOutput({"r1": 1024}, num_computed_tokens={"r1": 0}))
    # Counting on from step 1 (2 560 tokens), this step would store 1536-2047, which
    # the engine has not computed yet.
    assert step.store_ops == []
    step = sched.build_connector_meta(
        SchedulerOutput({"r1": 1024}, num_computed_tokens={"r1": 1024})
    )
    assert [(op.start, op.end) for op in step.store_ops] == [(1536, 2048)]


def test_a_request_preempted_and_resumed_before_the_next_step_keeps_its_new_load() -> None:
    gateway = FakeGateway()
    _cache(gateway, 2, 600)
    sched = _scheduler(gateway)
    request = _request(600)
    need, _ = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, list(range(40)), need or 0)
    assert len(sched.build_connector_meta(SchedulerOutput({"r1": 88})).retrieve_ops) == 1

    # vLLM's reset_prefix_cache(reset_running_requests=True) preempts r1 between steps,
    # and the next schedule() resumes it with new blocks: the step names it as
    # preempted and schedules it.
    need, _ = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, list(range(100, 140)), need or 0)
    meta = sched.build_connector_meta(SchedulerOutput({"r1": 600 - 512}, frozenset({"r1"})))
    (op,) = meta.retrieve_ops
    assert list(op.block_ids) == list(range(100, 132))

    # Stores after it use the new blocks too.
    stores = sched.build_connector_meta(SchedulerOutput({"r1": 1})).store_ops
    assert all(b >= 100 for op in stores for b in op.block_ids)


def test_after_a_cache_reset_the_engine_neither_finds_nor_shares_older_kv() -> None:
    gateway = FakeGateway()
    _cache(gateway, 2, 600)
    sched = _scheduler(gateway)
    looked_up, running = _request(600, "r1"), _request(600, "r2")
    need, _ = sched.get_num_new_matched_tokens(looked_up, 0)
    assert need == 512
    sched.get_num_new_matched_tokens(running, 0)
    sched.update_state_after_alloc(running, list(range(40)), 512)
    sched.build_connector_meta(SchedulerOutput({"r2": 64}))  # r2 runs (mid-prefill)

    assert sched.reset_cache() == 2
    # Nothing from before: the known request is looked up again (its session ended
    # first), and so is a new one with the same tokens; both miss.
    wait_until(lambda: gateway.names().count("EndSession") == 2, 10)
    assert sched.get_num_new_matched_tokens(looked_up, 0) == (0, False)
    fresh = _request(600, "r3")
    assert sched.get_num_new_matched_tokens(fresh, 0) == (0, False)
    salts = {req.cache_salt for req in gateway.requests("Lookup")[-2:]}
    assert salts == {sched.namespace}
    assert sched.namespace

    # r2 kept running with KV computed before the reset: it is never stored.
    assert sched.build_connector_meta(SchedulerOutput({"r2": 24})).store_ops == []
    # r3, computed after it, is stored in the new namespace only.
    sched.update_state_after_alloc(fresh, list(range(40, 80)), 0)
    (op,) = sched.build_connector_meta(SchedulerOutput({"r3": 600})).store_ops
    assert op.cache_salt == sched.namespace
    # A second reset moves to yet another namespace.
    first = sched.namespace
    sched.reset_cache()
    assert sched.namespace not in ("", first)
    sched.shutdown()


def test_a_worker_has_no_cache_to_reset() -> None:
    conn = KVMeshConnector(
        _scheduler(FakeGateway()).config, KVConnectorRole.WORKER, client=FakeGateway()
    )  # type: ignore[arg-type]
    with pytest.raises(Exception, match="scheduler"):
        conn.reset_cache()
