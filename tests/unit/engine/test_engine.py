"""The engine drives the connector hooks and keeps logits exact whatever kvmesh does.

kvmesh is played by :class:`FakeGateway` (in-process, maps the engine's
shared-memory KV file like a storage node); the real fleet is in tests/e2e.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvmesh.engine import Engine, EngineConfig, ModelConfig, NoFreeBlocksError, RequestOutput
from tests.support.fake_gateway import FakeGateway
from tests.support.waiting import wait_until

# Smaller than the demo's model, to keep the suite fast; tests/unit/engine/test_model.py
# covers the demo's dimensions.
MODEL = ModelConfig(num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=1024)


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def reference() -> Iterator[Engine]:
    with Engine(EngineConfig(model=MODEL, num_blocks=128)) as engine:
        yield engine


@pytest.fixture
def gateway() -> FakeGateway:
    return FakeGateway()


@pytest.fixture
def engine(gateway: FakeGateway) -> Iterator[Engine]:
    config = EngineConfig(model=MODEL, num_blocks=128, gateway="fake:0")
    with Engine(config, client=gateway) as eng:  # type: ignore[arg-type]
        yield eng


def _exact(a: RequestOutput, b: RequestOutput) -> bool:
    return torch.equal(a.logits, b.logits) and a.output_token_ids == b.output_token_ids


def test_a_repeated_prompt_is_served_from_kvmesh_with_bit_identical_logits(
    engine: Engine, reference: Engine, gateway: FakeGateway
) -> None:
    tokens = _tokens(700, seed=1)
    expected = reference.generate(tokens, max_new_tokens=3)

    cold = engine.generate(tokens, max_new_tokens=3)
    warm = engine.generate(tokens, max_new_tokens=3)

    assert (cold.tokens_from_cache, warm.tokens_from_cache, warm.lookup_hit_tokens) == (0, 512, 512)
    assert _exact(cold, expected)
    assert _exact(warm, expected)
    assert len(gateway.chunks) == 2
    assert not warm.load_failed


def test_a_fully_cached_prompt_recomputes_only_its_last_block(
    engine: Engine, reference: Engine
) -> None:
    tokens = _tokens(512, seed=2)
    engine.generate(tokens)

    warm = engine.generate(tokens)

    assert (warm.lookup_hit_tokens, warm.tokens_from_cache) == (512, 496)
    assert torch.equal(warm.logits, reference.generate(tokens).logits)


def test_the_cache_salt_separates_tenants(engine: Engine) -> None:
    tokens = _tokens(600, seed=3)
    engine.generate(tokens, cache_salt="tenant-a")

    assert engine.generate(tokens, cache_salt="tenant-b").tokens_from_cache == 0
    assert engine.generate(tokens, cache_salt="tenant-a").tokens_from_cache == 512


def test_a_short_load_is_recomputed_and_logits_stay_exact(
    engine: Engine, reference: Engine, gateway: FakeGateway
) -> None:
    tokens = _tokens(800, seed=4)
    engine.generate(tokens)
    gateway.retrieve_limit = 1

    warm = engine.generate(tokens)

    assert warm.load_failed
    assert warm.tokens_from_cache == 256
    assert torch.equal(warm.logits, reference.generate(tokens).logits)


def test_a_gateway_that_goes_down_costs_cache_hits_not_correctness(
    engine: Engine, reference: Engine, gateway: FakeGateway
) -> None:
    tokens = _tokens(600, seed=5)
    engine.generate(tokens)
    gateway.failing |= {"Lookup", "Retrieve", "Store", "FreeLookupLocks", "EndSession"}

    out = engine.generate(tokens)

    assert out.tokens_from_cache == 0
    assert torch.equal(out.logits, reference.generate(tokens).logits)


def test_a_slow_lookup_is_polled_until_it_completes(engine: Engine, gateway: FakeGateway) -> None:
    tokens = _tokens(600, seed=6)
    engine.generate(tokens)
    gateway.pending_polls = 3

    out = engine.generate(tokens)

    assert out.tokens_from_cache == 512
    assert gateway.names().count("QueryPrefetchStatus") == 4


def test_each_request_follows_the_vllm_hook_order(engine: Engine, gateway: FakeGateway) -> None:
    tokens = _tokens(600, seed=7)
    engine.generate(tokens)
    # Its EndSession is sent off the scheduler's loop: let it land before clearing.
    wait_until(lambda: "EndSession" in gateway.names())
    gateway.calls.clear()

    engine.generate(tokens)

    # Lookup → (free locks of unretrieved chunks: none here) → Retrieve → Store
    # (nothing new: the hit is not stored again) → EndSession (sent off the
    # scheduler's loop, so waited for here).
    wait_until(lambda: "EndSession" in gateway.names())
    assert gateway.names() == ["Lookup", "Retrieve", "EndSession"]


def test_blocks_are_returned_after_every_request(engine: Engine, gateway: FakeGateway) -> None:
    free = engine.allocator.num_free_blocks
    engine.generate(_tokens(300, seed=8), max_new_tokens=2)
    gateway.failing.add("Retrieve")
    engine.generate(_tokens(300, seed=8))

    assert engine.allocator.num_free_blocks == free


def test_close_unregisters_and_removes_the_shared_memory_file(gateway: FakeGateway) -> None:
    config = EngineConfig(model=MODEL, num_blocks=16, gateway="fake:0")
    engine = Engine(config, client=gateway)  # type: ignore[arg-type]
    path = engine.kv.path
    assert gateway.registered
    engine.close()

    assert not gateway.registered
    assert not os.path.exists(path)


def test_a_refused_registration_leaves_no_shared_memory_behind(gateway: FakeGateway) -> None:
    gateway.failing.add("RegisterKVCache")

    # A folder of this test's own: other workers' engines come and go in /dev/shm.
    shm_dir = Path(tempfile.mkdtemp(prefix="kvmesh-test-engine-", dir="/dev/shm"))
    try:
        config = EngineConfig(model=MODEL, num_blocks=16, gateway="fake:0", shm_dir=str(shm_dir))
        with pytest.raises(Exception, match="RegisterKVCache is down"):
            Engine(config, client=gateway)  # type: ignore[arg-type]
        assert list(shm_dir.iterdir()) == []
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_a_request_that_gets_no_blocks_still_ends_its_session(gateway: FakeGateway) -> None:
    config = EngineConfig(model=MODEL, num_blocks=8, gateway="fake:0")
    with Engine(config, client=gateway) as engine:  # type: ignore[arg-type]
        with pytest.raises(NoFreeBlocksError):
            engine.generate(_tokens(300, seed=9), request_id="too-long")

        wait_until(lambda: gateway.requests("EndSession"))
        assert [r.request_id for r in gateway.requests("EndSession")] == ["too-long"]
        assert engine.allocator.num_free_blocks == 7
