"""The connector under an engine's life: preemption, a gateway that forgets, failures.

Against :class:`FakeGateway` (an in-process gateway + storage) and the shared
KV cache of :mod:`kvmesh.engine`; the real-vLLM tests cover the same through
vLLM (tests/e2e/with_vllm).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from kvmesh.connector import KVConnectorRole, KVMeshConnector, SchedulerOutput
from kvmesh.engine import SharedKVCache
from tests.support.fake_gateway import FakeGateway, FakeRpcError
from tests.support.waiting import wait_until
from tests.unit.connector.test_connector import BLOCK, _cache, _config, _request, _scheduler


@dataclass
class GatedGateway(FakeGateway):
    """A gateway whose stores wait for :attr:`gate` (a store still copying)."""

    gate: threading.Event = field(default_factory=threading.Event)
    storing: threading.Event = field(default_factory=threading.Event)

    def store(self, request: Any, *, timeout: float | None = None, **kw: Any) -> Any:
        self.storing.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().store(request, timeout=timeout, **kw)


@pytest.fixture
def kv() -> Iterator[SharedKVCache]:
    with SharedKVCache(num_layers=2, num_blocks=80, block_size=BLOCK, kv_heads=1, head_dim=4) as c:
        yield c


def _worker(gateway: FakeGateway, kv: SharedKVCache, **overrides: object) -> KVMeshConnector:
    conn = KVMeshConnector(_config(**overrides), KVConnectorRole.WORKER, client=gateway)  # type: ignore[arg-type]
    names = kv.named_layers()
    conn.register_kv_caches(names, dict(zip(names, kv.regions(), strict=True)))
    return conn


def test_a_preempted_requests_running_store_is_finished_before_its_blocks_are_reused(
    kv: SharedKVCache,
) -> None:
    gateway = GatedGateway()
    conn = _worker(gateway, kv)
    sched = _scheduler(gateway)
    request = _request(512)
    try:
        sched.get_num_new_matched_tokens(request, 0)
        sched.update_state_after_alloc(request, list(range(1, 33)), 0)
        conn.save_kv(sched.build_connector_meta(SchedulerOutput({"r1": 512})))
        assert gateway.storing.wait(10)

        # The engine preempts r1 (frees its blocks): the next step's plan names it, and the
        # worker does not let that step run while the store still reads the blocks.
        meta = sched.build_connector_meta(SchedulerOutput({}, frozenset({"r1", "unknown"})))
        assert meta.preempted == ["r1"]
        waited: list[int] = []
        waiter = threading.Thread(
            target=lambda: waited.append(conn.finish_saves_of(meta.preempted))
        )
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive(), "the step went on while the store still read freed blocks"
        gateway.gate.set()
        waiter.join(10)
        assert waited == [1]
        assert conn.finish_saves_of(meta.preempted) == 0  # nothing running any more
    finally:
        gateway.gate.set()
        conn.shutdown()


def test_a_preempted_request_without_stores_needs_no_wait_and_plans_again_on_resume() -> None:
    gateway = FakeGateway()
    _cache(gateway, 2, 600)
    sched = _scheduler(gateway)
    request = _request(600)
    need, _ = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, list(range(40)), need or 0)
    assert len(sched.build_connector_meta(SchedulerOutput({"r1": 88})).retrieve_ops) == 1
    meta = sched.build_connector_meta(SchedulerOutput({}, frozenset({"r1"})))
    assert meta.preempted == []  # no store started: nothing reads its blocks
    assert meta.retrieve_ops == []  # its load is planned again when it resumes

    need, _ = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, list(range(100, 140)), need or 0)
    (op,) = sched.build_connector_meta(SchedulerOutput({"r1": 600 - 512})).retrieve_ops
    assert list(op.block_ids) == list(range(100, 132))


def test_a_load_that_cannot_be_planned_becomes_a_load_error_not_an_exception(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway = FakeGateway()
    _cache(gateway, 2, 600)
    sched = _scheduler(gateway)
    request = _request(600)
    need, _ = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, list(range(40)), need or 0)

    def broken(*_: object) -> None:
        raise RuntimeError("planning bug")

    monkeypatch.setattr(type(sched), "_plan", broken)
    meta = sched.build_connector_meta(SchedulerOutput({"r1": 88}))
    assert meta.retrieve_ops == []
    assert meta.failed_blocks == list(range(40))  # vLLM recomputes them


def test_a_gateway_that_forgot_the_engine_is_told_again_by_the_heartbeat(
    kv: SharedKVCache,
) -> None:
    gateway = FakeGateway()
    conn = _worker(gateway, kv, heartbeat_s=0.05)
    try:
        assert conn.registrations == 1
        gateway.registered = False  # a restarted (or reaping) gateway
        wait_until(lambda: conn.registrations == 2 and conn.registered, 10)
        assert gateway.registered
        assert gateway.requests("Ping")
    finally:
        conn.shutdown()


def test_a_gateway_down_at_start_gets_the_registration_once_it_answers(
    kv: SharedKVCache,
) -> None:
    gateway = FakeGateway(failing={"RegisterKVCache"})
    conn = KVMeshConnector(_config(heartbeat_s=0.05), KVConnectorRole.WORKER, client=gateway)  # type: ignore[arg-type]
    names = kv.named_layers()
    try:
        with pytest.raises(Exception, match="RegisterKVCache is down"):
            conn.register_kv_caches(names, dict(zip(names, kv.regions(), strict=True)))
        assert not conn.registered
        gateway.failing.clear()
        wait_until(lambda: conn.registered and gateway.registered, 10)
    finally:
        conn.shutdown()


def test_a_retrieve_that_raises_is_a_load_error_for_its_blocks(kv: SharedKVCache) -> None:
    gateway = FakeGateway()
    conn = _worker(gateway, kv)
    sched = _scheduler(gateway)
    _cache(gateway, 2, 600)
    request = _request(600)
    need, _ = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, list(range(40)), need or 0)
    meta = sched.build_connector_meta(SchedulerOutput({"r1": 88}))

    def broken(*_: object, **__: object) -> None:
        raise ValueError("not an RpcError")

    gateway.retrieve = broken  # type: ignore[method-assign]
    try:
        conn.start_load_kv(meta)
        assert conn.wait_for_load() == {"r1"}
        assert conn.get_block_ids_with_load_errors() == set(range(32))
    finally:
        conn.shutdown()


def test_the_heartbeat_ends_the_back_off_as_soon_as_the_gateway_answers_again() -> None:
    """After an outage, lookups resume with the first heartbeat that gets through."""
    gateway = FakeGateway(failing={"Lookup", "Ping"})
    sched = _scheduler(gateway, instance_id="instance-a", heartbeat_s=0.02)
    try:
        assert sched.get_num_new_matched_tokens(_request(600), 0) == (0, False)
        wait_until(lambda: sched._backoff_s >= 8, 30)  # several beats failed meanwhile
        assert sched.gateway_down()
        gateway.failing.clear()
        wait_until(lambda: not sched.gateway_down(), 5)  # far sooner than the back-off
        assert [r.engine_id for r in gateway.requests("Ping")][-1] == "instance-a"
    finally:
        sched.shutdown()


def test_a_gateway_restarted_with_another_chunk_size_is_followed_by_the_plans() -> None:
    gateway = FakeGateway()
    sched = _scheduler(gateway, instance_id="instance-a", heartbeat_s=0.02)
    try:
        sched.get_num_new_matched_tokens(_request(600), 0)
        assert sched.chunk_size == 256
        gateway.chunk_size = 512  # the node came back upgraded
        wait_until(lambda: sched.chunk_size == 512, 10)
        asked = len(gateway.requests("GetChunkSize"))
        gateway.chunk_size = 24  # not a multiple of the engine's block size: ignored
        wait_until(lambda: len(gateway.requests("GetChunkSize")) >= asked + 3, 10)
        assert sched.chunk_size == 512
    finally:
        sched.shutdown()


@dataclass
class RefusingGateway(FakeGateway):
    """A gateway that refuses the registration (another engine's KV format, say)."""

    def register_kv_cache(self, request: Any, *, timeout: float | None = None, **_: Any) -> Any:
        self._enter("RegisterKVCache", request)
        raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "MODEL_KV_FORMAT_CONFLICT")


def test_a_refused_registration_is_said_once_and_tried_again_quietly(
    kv: SharedKVCache, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = RefusingGateway()
    caplog.set_level(logging.WARNING, logger="kvmesh.connector")
    conn = KVMeshConnector(_config(heartbeat_s=0.02), KVConnectorRole.WORKER, client=gateway)  # type: ignore[arg-type]
    names = kv.named_layers()
    try:
        with pytest.raises(grpc.RpcError):
            conn.register_kv_caches(names, dict(zip(names, kv.regions(), strict=True)))
        wait_until(lambda: gateway.names().count("RegisterKVCache") >= 5, 10)
        said = [r for r in caplog.records if "kvmesh stays off" in r.getMessage()]
        assert len(said) == 1
        assert "MODEL_KV_FORMAT_CONFLICT" in said[0].getMessage()
        assert not conn.registered
    finally:
        conn.shutdown()
