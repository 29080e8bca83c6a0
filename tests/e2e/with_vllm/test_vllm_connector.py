"""Real vLLM (CPU build) with kvmesh's connector: fresh processes reuse prefixes through kvmesh.

Every engine is a fresh ``vllm.LLM`` process (``kvmesh.engine.vllm.worker``) with
vLLM's own prefix caching off, so a cached token can only have come from kvmesh.
Prompts are 8000 tokens: longer than vLLM's 4096-token prefill chunk, so each
one is stored in two steps and loaded into blocks of both.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from kvmesh.engine.vllm.runner import run_engine
from tests.e2e.support import require_fleet_services, start_fleet
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 8000
CHUNK = 256
#: Complete chunks of a prompt, minus nothing: vLLM recomputes only the tail.
CACHED = PROMPT_TOKENS // CHUNK * CHUNK
TOP_K = 5
#: Top-k logprobs of a warm run equal the cold run's within two bf16 steps of a logit
#: near 1 (2**-6): attention over a loaded prefix sums in another order than a full
#: prefill, as with vLLM's own prefix cache. A wrong block changes the top-k ids.
LOGPROB_TOLERANCE = 2**-6


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(PROMPT_TOKENS)]


def assert_same_answer(cold: dict[str, Any], warm: dict[str, Any]) -> None:
    """Greedy tokens equal; per step the same top-k ids with logprobs within tolerance."""
    assert warm["token_ids"] == cold["token_ids"]
    assert len(warm["logprobs"]) == len(cold["logprobs"]) > 0
    for step_cold, step_warm in zip(cold["logprobs"], warm["logprobs"], strict=True):
        assert set(step_warm) == set(step_cold)
        for token, logprob in step_cold.items():
            assert abs(step_warm[token] - logprob) <= LOGPROB_TOLERANCE, (token, logprob)


def _two_node_runs(tmp: Path, redis_url: str, model: Path) -> Runs:
    """Three fresh vLLM processes over a two-node fleet whose nodes share a Redis L2."""
    require_fleet_services()
    l2 = json.dumps(
        {
            "type": "redis",
            "url": redis_url,
            "key_prefix": f"kvmesh-vllm-{uuid.uuid4().hex[:8]}:",
            "shared": True,
        }
    )
    fleet = start_fleet(tmp, nodes=2, extra_storage_args=["--l2", l2])
    try:
        base = {"model": str(model), "max_tokens": 3, "logprobs": TOP_K}
        p, q = prompt(1), prompt(2)
        node0 = fleet.endpoint("node-0-gateway")
        node1 = fleet.endpoint("node-1-gateway")
        (a,) = run_engine({**base, "prompts": [p], "gateway": node0})
        b_p, b_q = run_engine({**base, "prompts": [p, q], "gateway": node1})
        (c,) = run_engine({**base, "prompts": [q], "gateway": node0})
    finally:
        fleet.stop()
    return Runs(a, b_p, b_q, c)


@dataclass
class Runs:
    """Three fresh vLLM processes: A on node 0, then B on node 1, then C on node 0."""

    cold_p: dict[str, Any]
    warm_p_other_node: dict[str, Any]
    cold_q_other_node: dict[str, Any]
    warm_q: dict[str, Any]


@pytest.fixture(scope="session")
def runs(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, _redis_session: ServerProcess
) -> Runs:
    """The runs, made once per test run: the first xdist worker to ask runs the engines,
    the others read its results (each engine costs 20-40 s here)."""
    root = tmp_path_factory.getbasetemp().parent
    done = root / "kvmesh-vllm-two-node-runs.json"
    with FileLock(str(root / "kvmesh-vllm-two-node-runs.lock")):
        if not done.exists():
            made = _two_node_runs(tmp_path_factory.mktemp("vllm-fleet"), _redis_session.url,
                                  tiny_model)  # fmt: skip
            done.write_text(json.dumps(asdict(made)))
        return Runs(**json.loads(done.read_text()))


def test_a_cold_prompt_is_computed_by_vllm(runs: Runs) -> None:
    assert runs.cold_p["cached_tokens"] == 0
    assert runs.cold_q_other_node["cached_tokens"] == 0


def test_a_fresh_vllm_process_gets_the_prompt_from_kvmesh_with_the_same_answer(runs: Runs) -> None:
    """Longer than one prefill chunk: stored in two steps, loaded whole but the last token."""
    assert runs.warm_p_other_node["cached_tokens"] == CACHED
    assert_same_answer(runs.cold_p, runs.warm_p_other_node)


def test_two_vllm_processes_on_two_nodes_reuse_each_others_prefixes(runs: Runs) -> None:
    """Node 1's engine reused node 0's prompt; node 0's next engine reuses node 1's."""
    assert runs.warm_p_other_node["cached_tokens"] == CACHED
    assert runs.warm_q["cached_tokens"] == CACHED
    assert_same_answer(runs.cold_q_other_node, runs.warm_q)
