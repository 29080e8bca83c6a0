"""A real transformer through the connector and a real fleet: cache hits never change logits.

Every test compares, bit for bit, the logits (and a few greedy tokens) of a
run whose prefix KV came from kvmesh with a run of the same prompt computed
without kvmesh — from L1, and from L2 after L1 was dropped (a second node
sharing only L2: test_shared_l2.py). One single-node fleet serves the module.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.bench import node_figures
from kvmesh.cli.fleet import Fleet
from kvmesh.cli.main import main
from kvmesh.connector import KVConnectorRole, KVMeshConnector, KVMeshConnectorConfig, Request
from kvmesh.engine import Engine, EngineConfig
from kvmesh.gateway.client import GatewayClient
from tests.e2e.support import (
    L1,
    L2,
    MODEL,
    run_prompt,
    same_output,
    stored_chunks,
    tokens,
)
from tests.support.ports import free_port
from tests.support.waiting import wait_until


def test_logits_with_the_prefix_served_from_kvmesh_equal_logits_computed_without_it(
    engine: Engine, reference: Engine, salt: str
) -> None:
    prompt = tokens(1500, seed=1)
    expected = run_prompt(reference, prompt, "")

    cold = run_prompt(engine, prompt, salt)
    warm = run_prompt(engine, prompt, salt)

    assert cold.tokens_from_cache == 0
    assert (warm.lookup_hit_tokens, warm.tokens_from_cache) == (1280, 1280)
    assert not warm.load_failed
    assert not cold.store_failed
    assert same_output(cold, expected)
    assert same_output(warm, expected)


def test_a_fully_cached_prompt_recomputes_only_its_last_block(
    engine: Engine, reference: Engine, salt: str
) -> None:
    prompt = tokens(1024, seed=2)
    run_prompt(engine, prompt, salt)

    warm = run_prompt(engine, prompt, salt)

    assert (warm.lookup_hit_tokens, warm.tokens_from_cache) == (1024, 1008)
    assert same_output(warm, run_prompt(reference, prompt, ""))


def test_a_prompt_sharing_a_prefix_is_served_its_complete_shared_chunks(
    engine: Engine, reference: Engine, salt: str
) -> None:
    first = tokens(1300, seed=3)
    second = first[:1000] + tokens(700, seed=4)
    run_prompt(engine, first, salt)

    out = run_prompt(engine, second, salt)

    assert out.tokens_from_cache == 768
    assert same_output(out, run_prompt(reference, second, ""))


def test_loads_started_by_the_scheduler_give_the_same_logits_and_copy_once(
    fleet: Fleet, reference: Engine, salt: str
) -> None:
    """The engine's scheduler sends RetrieveAhead for each load; its worker's Retrieve
    joins it, or (when it got there first) copies itself and the ahead call starts
    nothing. Either way one copy per load and the logits of a cold run."""
    url = f"http://{fleet.endpoint('node-0-gateway', 'metrics')}/metrics"

    def counts() -> dict[str, float]:
        samples = node_figures.scrape([url])
        names = ("retrieves", "retrieves_ahead", "retrieves_joined", "retrieves_ahead_refused")
        return {n: sum(v for (k, _), v in samples.items() if k == f"kvmesh_gateway_{n}_total")
                for n in names}  # fmt: skip

    config = EngineConfig(
        model=MODEL,
        num_blocks=512,
        gateway=fleet.endpoint("node-0-gateway", "lane"),
        load_ahead=True,
    )
    prompt = tokens(1300, seed=9)
    with Engine(config) as engine:
        run_prompt(engine, prompt, salt)
        before = counts()
        warm = [run_prompt(engine, prompt, salt) for _ in range(3)]
        after = counts()
    delta = {name: after[name] - before[name] for name in after}

    expected = run_prompt(reference, prompt, "")
    assert all(out.tokens_from_cache == 1280 and same_output(out, expected) for out in warm)
    assert delta["retrieves"] == 3  # one copy per load, joined or not
    assert delta["retrieves_ahead"] + delta["retrieves_ahead_refused"] == 3
    assert delta["retrieves_joined"] == delta["retrieves_ahead"]


def test_another_cache_salt_sees_nothing(engine: Engine, salt: str) -> None:
    prompt = tokens(600, seed=5)
    run_prompt(engine, prompt, salt)

    assert run_prompt(engine, prompt, salt + "-other").tokens_from_cache == 0


def test_chunks_dropped_from_l1_come_back_from_l2_with_identical_logits(
    fleet: Fleet, engine: Engine, reference: Engine, salt: str
) -> None:
    prompt = tokens(1200, seed=6)
    storage = fleet.endpoint("node-0-storage")
    cold = run_prompt(engine, prompt, salt)
    # L1 → L2 is asynchronous: wait until the disk L2 holds all four chunks.
    wait_until(lambda: stored_chunks(storage, L2, salt) == 4, timeout=60)

    with GatewayClient(fleet.endpoint("node-0-gateway")) as client:
        cleared = client.clear(gateway_pb2.ClearRequest(force=True)).cleared_objects
    assert cleared >= 4
    assert stored_chunks(storage, L1, salt) == 0

    warm = run_prompt(engine, prompt, salt)

    assert (warm.tokens_from_cache, warm.lookup_l2_hit_chunks) == (1024, 4)
    assert same_output(warm, cold)
    assert same_output(warm, run_prompt(reference, prompt, ""))


def test_a_scheduler_whose_gateway_is_down_answers_zero_instead_of_waiting() -> None:
    config = KVMeshConnectorConfig(
        gateway=f"127.0.0.1:{free_port()}", model_name="m", rpc_timeout_s=2.0
    )
    sched = KVMeshConnector(config, KVConnectorRole.SCHEDULER)
    try:
        request = Request("r", tokens(600, seed=8))
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        assert sched.request_finished(request) is False
    finally:
        sched.shutdown()


def test_an_engine_that_cannot_register_leaves_no_shared_memory() -> None:
    # A folder of this test's own: other tests' engines (other workers) come and go
    # in /dev/shm meanwhile.
    shm_dir = Path(tempfile.mkdtemp(prefix="kvmesh-test-engine-", dir="/dev/shm"))
    try:
        config = EngineConfig(
            model=MODEL,
            num_blocks=16,
            gateway=f"127.0.0.1:{free_port()}",
            rpc_timeout_s=2.0,
            shm_dir=str(shm_dir),
        )
        with pytest.raises(grpc.RpcError):
            Engine(config)
        assert list(shm_dir.iterdir()) == []
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_kvmesh_demo_reports_a_warm_hit_with_matching_logits(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "demo",
        "--gateway", fleet.endpoint("node-0-gateway"),
        "--prompt-tokens", "1024",
        "--shared-prefix-tokens", "700",
        "--layers", "2",
        "--json",
        "--no-progress",
    ]  # fmt: skip

    assert main(argv) == 0

    result = json.loads(capsys.readouterr().out)
    assert result["prompt_tokens"] == 1024
    assert result["logits_match"] is True
    assert result["tokens_from_cache"] == 1008
    assert result["cold"]["tokens_from_cache"] == 0
    assert result["ttft_cold_ms"] > 0
    assert result["ttft_warm_ms"] > 0
    assert result["speedup"] > 0
    assert result["shared_prefix"]["tokens_from_cache"] == 512
    assert result["shared_prefix"]["logits_match"] is True
    params = result["parameters"]
    assert (params["chunk_size"], params["gateway"]) == (256, fleet.endpoint("node-0-gateway"))
    assert params["model"]["num_layers"] == 2


def test_the_coordinator_directory_and_kvmesh_status_show_every_stored_chunk(
    fleet: Fleet, engine: Engine, salt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvmesh.api.coordinator.v1 import directory_pb2
    from kvmesh.coordinator.client import DirectoryClient
    from tests.e2e.support import MODEL_NAME

    prompt = tokens(1300, seed=7)
    run_prompt(engine, prompt, salt)
    coordinator = fleet.endpoint("coordinator")
    client = DirectoryClient(coordinator)
    query = directory_pb2.LookupRequest(
        tokens=directory_pb2.TokenQuery(
            model_name=MODEL_NAME, world_size=1, cache_salt=salt, token_ids=prompt
        )
    )

    def placed(tier: int) -> bool:
        found = client.lookup(query)
        return found.chunks == 5 and all(
            any(p.tier == tier and p.instance_id == "node-0" for p in r.placements)
            for r in found.results
        )

    try:
        # Every complete chunk is in node-0's L1 at once, and on its disk L2 after write-through.
        wait_until(lambda: placed(L1), timeout=30)
        wait_until(lambda: placed(L2), timeout=60)
        found = client.lookup(query)
        assert found.cached_prefix_chunks == 5
        for result in found.results:
            l1 = next(p for p in result.placements if p.tier == L1)
            assert (l1.backend, l1.size_bytes) == ("dram", MODEL.kv_bytes_per_token * 256)
            assert any(p.tier == L2 and p.backend == "disk" for p in result.placements)
    finally:
        client.close()
    assert main(["status", "--coordinator", coordinator]) == 0
    shown = capsys.readouterr().out
    assert "node-0" in shown
    assert "GAP" not in shown
    assert "dram" in shown
    assert "disk" in shown
