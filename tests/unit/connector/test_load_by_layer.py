"""Loads by layer: a retrieve sent in parts of layers, each layer waiting for its own part.

See docs/vllm.md, "Loads by layer". Driven against :class:`FakeGateway` (an
in-process gateway that honours ``RetrieveRequest.layers``) and a real
shared-memory KV cache of 5 layers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvmesh.connector import KVConnectorRole, KVMeshConnector, KVMeshConnectorConfig, Request
from kvmesh.connector.layered import LayeredLoad, layer_groups
from kvmesh.connector.metadata import SchedulerOutput
from kvmesh.engine import SharedKVCache
from tests.support.fake_gateway import FakeGateway

BLOCK = 16
LAYERS = 5


def _config() -> KVMeshConnectorConfig:
    return KVMeshConnectorConfig(gateway="fake:0", model_name="m", block_size=BLOCK)


@pytest.fixture
def kv() -> Iterator[SharedKVCache]:
    with SharedKVCache(
        num_layers=LAYERS, num_blocks=80, block_size=BLOCK, kv_heads=1, head_dim=4
    ) as cache:
        yield cache


@pytest.fixture
def setup(kv: SharedKVCache) -> Iterator[tuple[KVMeshConnector, KVMeshConnector, FakeGateway]]:
    gateway = FakeGateway()
    worker = KVMeshConnector(_config(), KVConnectorRole.WORKER, client=gateway)  # type: ignore[arg-type]
    names = kv.named_layers()
    worker.register_kv_caches(names, dict(zip(names, kv.regions(), strict=True)))
    scheduler = KVMeshConnector(_config(), KVConnectorRole.SCHEDULER, client=gateway)  # type: ignore[arg-type]
    yield worker, scheduler, gateway
    worker.shutdown()
    scheduler.shutdown()


STORED = list(range(1, 33))
LOADED = list(range(40, 72))


def _store_then_start_load(
    worker: KVMeshConnector, scheduler: KVMeshConnector, kv: SharedKVCache
) -> None:
    """Store a 512-token prompt from blocks 1..32, then start loading it into 40..71 by layer."""
    for layer in kv.layers:
        layer[:, STORED] = torch.randn(2, len(STORED), BLOCK, 1, 4)
    first = Request("r1", list(range(1000, 1512)))
    scheduler.get_num_new_matched_tokens(first, 0)
    scheduler.update_state_after_alloc(first, STORED, 0)
    worker.save_kv(scheduler.build_connector_meta(SchedulerOutput({"r1": 512})))
    assert worker.wait_for_save() == set()
    scheduler.request_finished(first)
    again = Request("r2", list(range(1000, 1512)))
    need, _ = scheduler.get_num_new_matched_tokens(again, 0)
    assert need == 496  # 512 less the last block: its last token is computed by the engine
    scheduler.update_state_after_alloc(again, LOADED, need or 0)
    worker.start_load_kv(scheduler.build_connector_meta(SchedulerOutput({"r2": 16})), by_layer=True)


def test_groups_start_with_one_layer_and_double() -> None:
    assert layer_groups(1) == [(0, 1)]
    assert layer_groups(5) == [(0, 1), (1, 3), (3, 5)]
    assert layer_groups(30) == [(0, 1), (1, 3), (3, 7), (7, 15), (15, 30)]
    with pytest.raises(ValueError, match="num_layers"):
        layer_groups(0)


def test_parts_load_what_one_whole_retrieve_loads_and_send_the_tokens_once(
    setup: tuple[KVMeshConnector, KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    worker, scheduler, gateway = setup
    _store_then_start_load(worker, scheduler, kv)
    for layer in range(LAYERS):
        worker.wait_for_layer(layer)
    assert worker.wait_for_load() == set()
    for layer in kv.layers:
        assert torch.equal(layer[:, LOADED[:31]], layer[:, STORED[:31]])
    parts = gateway.requests("Retrieve")
    assert [(r.layers.start, r.layers.end) for r in parts] == layer_groups(LAYERS)
    assert [len(r.range.token_ids) for r in parts] == [512, 0, 0]
    assert worker.get_block_ids_with_load_errors() == set()


def test_a_layer_waits_for_its_own_part_only(
    setup: tuple[KVMeshConnector, KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    worker, scheduler, gateway = setup
    gateway.later_parts_gate = threading.Event()
    _store_then_start_load(worker, scheduler, kv)
    worker.wait_for_layer(0)  # part 0 is not held back
    assert torch.equal(kv.layers[0][:, LOADED[:31]], kv.layers[0][:, STORED[:31]])
    waiter = threading.Thread(target=worker.wait_for_layer, args=(3,))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # layer 3's part is held by the gateway
    gateway.later_parts_gate.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert worker.wait_for_load() == set()


def test_a_failed_part_fails_the_whole_load_and_sends_no_more_parts(
    setup: tuple[KVMeshConnector, KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    worker, scheduler, gateway = setup
    gateway.failing_retrieves = {1}
    _store_then_start_load(worker, scheduler, kv)
    worker.wait_for_layer(4)  # released by the failure, not stuck
    assert worker.wait_for_load() == {"r2"}
    assert len(gateway.requests("Retrieve")) == 2
    assert worker.get_block_ids_with_load_errors() == set(LOADED)


def test_a_short_part_reports_the_blocks_the_shortest_part_left(
    setup: tuple[KVMeshConnector, KVMeshConnector, FakeGateway], kv: SharedKVCache
) -> None:
    worker, scheduler, gateway = setup
    gateway.retrieve_limit = 1
    _store_then_start_load(worker, scheduler, kv)
    assert worker.wait_for_load() == {"r2"}
    assert worker.get_block_ids_with_load_errors() == set(LOADED[16:])


def test_a_layer_out_of_range_or_unknown_waits_for_every_part() -> None:
    load = LayeredLoad(layer_groups(5))
    load.part_done(0)
    done = threading.Event()

    def wait() -> None:
        load.wait_for_layer(None)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    assert not done.wait(0.2)
    load.part_done(1)
    assert not done.wait(0.2)
    load.part_done(2)
    assert done.wait(5)
    load.wait_for_layer(17)  # beyond the layers: every part, all done now
