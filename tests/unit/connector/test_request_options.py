"""A request's own switches: not looked up, not stored (docs/vllm.md, "Per-request switches")."""

from __future__ import annotations

import logging

import pytest

from kvmesh.connector import Request, SchedulerOutput
from kvmesh.connector.request_options import OFF, RequestOptions, request_options
from tests.support.fake_gateway import FakeGateway
from tests.unit.connector.test_connector import _cache, _scheduler


def test_absent_parameters_or_entry_keep_the_defaults() -> None:
    assert request_options(None, "r") == RequestOptions(lookup=True, store=True)
    assert request_options({}, "r") == RequestOptions()
    # Other connectors' keys are theirs.
    assert request_options({"do_remote_prefill": True, "kvmesh": None}, "r") == RequestOptions()


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({}, RequestOptions()),
        ({"lookup": False}, RequestOptions(lookup=False, store=True)),
        ({"store": False}, RequestOptions(lookup=True, store=False)),
        ({"lookup": False, "store": False}, OFF),
        ({"lookup": True, "store": True}, RequestOptions()),
    ],
)
def test_each_switch_is_read(entry: dict[str, bool], expected: RequestOptions) -> None:
    assert request_options({"kvmesh": entry}, "r") == expected


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (["kvmesh"], "transfer parameters are a list"),
        ({"kvmesh": "off"}, '"kvmesh" is a str, not a mapping'),
        ({"kvmesh": {"lookups": False}}, "unknown key(s) lookups"),
        ({"kvmesh": {"store": "false"}}, "\"kvmesh.store\" is 'false', not true or false"),
        ({"kvmesh": {"lookup": 0}}, '"kvmesh.lookup" is 0, not true or false'),
    ],
)
def test_an_unreadable_entry_keeps_kvmesh_out_and_says_why(
    params: object, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The connector cannot refuse the request: computing it is never wrong, and a
    prompt someone may have asked not to keep is not kept."""
    with caplog.at_level(logging.WARNING, logger="kvmesh.connector.request_options"):
        assert request_options(params, "req-7") == OFF
    (record,) = caplog.records
    assert "req-7" in record.getMessage()
    assert says in record.getMessage()


def _request(n: int, rid: str, **switches: bool) -> Request:
    return Request(rid, list(range(1000, 1000 + n)), **switches)


def test_a_request_with_lookup_off_is_computed_without_asking_and_still_stored() -> None:
    gateway = FakeGateway()
    _cache(gateway, 2, 768)  # its first two chunks are in kvmesh
    sched = _scheduler(gateway)
    try:
        request = _request(768, "r1", lookup=False)
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        assert "Lookup" not in gateway.names()
        sched.update_state_after_alloc(request, list(range(48)), 0)
        (op,) = sched.build_connector_meta(SchedulerOutput({"r1": 768})).store_ops
        assert (op.start, op.end) == (0, 768)
        # The same tokens with the default switches are a hit.
        assert sched.get_num_new_matched_tokens(_request(768, "r2"), 0)[0] == 512
    finally:
        sched.shutdown()


def test_a_request_with_store_off_loads_its_hit_and_stores_nothing() -> None:
    gateway = FakeGateway()
    _cache(gateway, 1, 768)
    sched = _scheduler(gateway)
    try:
        request = _request(768, "r1", store=False)
        need, _ = sched.get_num_new_matched_tokens(request, 0)
        assert need == 256
        sched.update_state_after_alloc(request, list(range(48)), need)
        meta = sched.build_connector_meta(SchedulerOutput({"r1": 512}))
        assert [op.request_id for op in meta.retrieve_ops] == ["r1"]
        assert meta.store_ops == []
        # Nor in a later step (its decode, or the rest of a chunked prefill).
        assert sched.build_connector_meta(SchedulerOutput({"r1": 1})).store_ops == []
        # A request with the defaults computing the same tokens stores them.
        other = _request(768, "r2")
        sched.get_num_new_matched_tokens(other, 0)
        sched.update_state_after_alloc(other, list(range(48, 96)), 0)
        (op,) = sched.build_connector_meta(SchedulerOutput({"r2": 768})).store_ops
        assert (op.start, op.end) == (256, 768)
    finally:
        sched.shutdown()


def test_a_request_switched_off_entirely_costs_the_gateway_no_call() -> None:
    gateway = FakeGateway()
    _cache(gateway, 2, 768)
    sched = _scheduler(gateway)
    try:
        request = _request(768, "r1", lookup=False, store=False)
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        sched.update_state_after_alloc(request, list(range(48)), 0)
        assert sched.build_connector_meta(SchedulerOutput({"r1": 768})).store_ops == []
        assert sched.request_finished(request) is False  # no store holds its blocks
        # A request with lookups off that stored ends its session (the store opened one).
        stored = _request(768, "r2", lookup=False)
        sched.get_num_new_matched_tokens(stored, 0)
        sched.update_state_after_alloc(stored, list(range(48, 96)), 0)
        assert sched.build_connector_meta(SchedulerOutput({"r2": 768})).store_ops
        assert sched.request_finished(stored) is True
        sched.flush_releases()
        assert [r.request_id for r in gateway.requests("EndSession")] == ["r2"]
        assert gateway.names().count("Lookup") == 0
    finally:
        sched.shutdown()


def test_lookup_off_stores_nothing_the_engines_own_cache_held_whole() -> None:
    """As with lookups on: a prompt whose complete chunks the engine held is not stored."""
    gateway = FakeGateway()
    sched = _scheduler(gateway)
    try:
        request = _request(600, "r1", lookup=False)
        assert sched.get_num_new_matched_tokens(request, 512) == (0, False)
        sched.update_state_after_alloc(request, list(range(40)), 0)
        assert sched.build_connector_meta(SchedulerOutput({"r1": 88})).store_ops == []
    finally:
        sched.shutdown()
