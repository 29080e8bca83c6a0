"""Real vLLM (CPU build) with kvmesh's connector: fresh processes reuse prefixes through kvmesh.

Every engine is a fresh ``vllm.LLM`` process (``kvmesh.engine.vllm.worker``) with
vLLM's own prefix caching off, so a cached token can only have come from kvmesh.
Prompts are 8000 tokens: longer than vLLM's 4096-token prefill chunk, so each
one is stored in two steps and loaded into blocks of both. The same two
processes also show that vLLM keeps answering once kvmesh is stopped.
"""

from __future__ import annotations

import json
import random
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvmesh.cli.demo_vllm import wait_events_acked
from kvmesh.engine.vllm.runner import is_paused, kill, results_and_log, resume, start_engine
from kvmesh.engine.vllm.worker import RESUMED
from tests.e2e.support import require_fleet_services, start_fleet
from tests.e2e.with_vllm.support import LOGPROB_TOLERANCE, TOP_K, resident_chunks
from tests.support.servers import ServerProcess
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 8000
CHUNK = 256
#: Complete chunks of a prompt, minus nothing: vLLM recomputes only the tail.
CACHED = PROMPT_TOKENS // CHUNK * CHUNK


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


def _fleet_runs(tmp: Path, redis_url: str, model: Path) -> Runs:
    """Two fresh vLLM processes over a two-node fleet whose nodes share a Redis L2.

    Both start at once (their 20-40 s start-ups overlap) and take turns at
    pauses: A on node 0 computes p; B on node 1 gets p from node 0 and computes
    q; A gets q from node 1; then the fleet stops and A computes p and q again.
    """
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
    # The connector's default deadlines. With 1 s for every call, the registration
    # included, B once recomputed p in a full suite run (four workers on two cores);
    # the registration now has its own deadline (register_timeout_s), and the subtests
    # print the engine's log. A stopped fleet refuses connections at once, so the
    # longer deadlines cost nothing after the stop.
    # One process per engine (vLLM's engine core and worker beside the connector's two
    # halves): a start costs a third of the CPU; the OpenAI server test (and kvmesh
    # bench vllm) run vLLM's usual three processes.
    base = {"model": str(model), "max_tokens": 3, "logprobs": TOP_K, "one_process": True}
    p, q = prompt(1), prompt(2)
    a_q, a_again, b_p = tmp / "a-before-q", tmp / "a-before-p-again", tmp / "b-before-p"
    # A's scheduler starts its loads ahead (load_ahead), B's worker loads by layer: both
    # ways give the cold run's answer.
    a = start_engine(
        {**base, "prompts": [p, q, p, q], "gateway": fleet.endpoint("node-0-gateway"),
         "pause_before": [{"index": 1, "path": str(a_q)}, {"index": 2, "path": str(a_again)}],
         "connector": {"load_ahead": "true", "log_level": "DEBUG"}}
    )  # fmt: skip
    # B loads by layer (vLLM bound to every core would load whole by default, as A does):
    # both ways of loading give the cold run's answer.
    b = start_engine(
        {**base, "prompts": [p, q], "gateway": fleet.endpoint("node-1-gateway"),
         "pause_before": {"index": 0, "path": str(b_p)},
         "connector": {"load_by_layer": "true", "log_level": "DEBUG"}}
    )  # fmt: skip
    stopped = False
    try:
        wait_paused(a, a_q)  # A computed p; its stores run in the background
        wait_holds(fleet.endpoint("node-0-storage"), CACHED // CHUNK)
        resume(b_p)
        b_runs, b_log = results_and_log(b)  # B exits once its stores of q are done
        assert wait_events_acked(fleet.endpoint("node-1-storage"))
        resume(a_q)
        wait_paused(a, a_again)
        fleet.stop()  # kvmesh goes away while A runs
        stopped = True
        resume(a_again)
        a_runs, a_log = results_and_log(a)
    finally:
        for engine in (a, b):
            kill(engine)
        if not stopped:
            fleet.stop()
    return Runs(a_runs[0], a_runs[1], a_runs[2:], a_log, b_runs[0], b_runs[1], b_log)


def wait_paused(engine: subprocess.Popen[str], pause: Path) -> None:
    wait_until(lambda: is_paused(pause) or engine.poll() is not None, 300)
    assert engine.poll() is None, "vLLM exited before its pause"


def wait_holds(storage: str, chunks: int) -> None:
    """Until the node holds ``chunks`` chunks and the coordinator's directory knows them."""
    wait_until(lambda: resident_chunks(storage) >= chunks, 60)
    assert wait_events_acked(storage)


@dataclass
class Runs:
    """A on node 0: p, q, then p and q again (kvmesh stopped); B on node 1: p, q."""

    cold_p: dict[str, Any]
    warm_q: dict[str, Any]
    after_stop: list[dict[str, Any]]
    a_log: str
    warm_p_other_node: dict[str, Any]
    cold_q_other_node: dict[str, Any]
    b_log: str


def test_vllm_processes_reuse_prompts_through_kvmesh_and_survive_it_stopping(
    tiny_model: Path,
    tmp_path: Path,
    redis_server: ServerProcess,
    subtests: pytest.Subtests,
) -> None:
    """One test over the two engines' runs (each engine costs 15-35 s to start here), with
    a subtest per claim: separate tests sharing the runs would each hold an xdist worker
    while one of them ran the engines."""
    runs = _fleet_runs(tmp_path, redis_server.url, tiny_model)
    with subtests.test("a cold prompt is computed by vLLM"):
        assert runs.cold_p["cached_tokens"] == 0
        assert runs.cold_q_other_node["cached_tokens"] == 0
        assert len(runs.cold_p["token_ids"]) == len(runs.cold_q_other_node["token_ids"]) == 3
    with subtests.test("a fresh vLLM process gets the prompt from kvmesh with the same answer"):
        # Longer than one prefill chunk: stored in two steps, loaded whole but the last token.
        assert runs.warm_p_other_node["cached_tokens"] == CACHED, runs.b_log[-3000:]
        assert_same_answer(runs.cold_p, runs.warm_p_other_node)
        # B loaded it by layer: parts of 1, 2 and 1 of the tiny model's 4 layers.
        parts = [line for line in runs.b_log.splitlines() if "by layers: parts done at" in line]
        assert len(parts) == 1, runs.b_log[-3000:]
        assert len(parts[0].split("parts done at")[1].split(",")) == 3
    with subtests.test("two vLLM processes on two nodes reuse each other's prefixes"):
        assert runs.warm_q["cached_tokens"] == CACHED, runs.a_log[-3000:]
        assert_same_answer(runs.cold_q_other_node, runs.warm_q)
        # A's scheduler sent the load ahead (started, or refused when its worker got there
        # first: the same answer either way).
        assert "started ahead" in runs.a_log, runs.a_log[-3000:]
    with subtests.test("kvmesh stopped mid-run: vLLM still answers"):
        # A's last two prompts ran after the fleet stopped: recomputed, the same answers,
        # and one clear warning per half of the connector (scheduler, worker), not one
        # per request.
        p_again, q_again = runs.after_stop
        assert p_again["cached_tokens"] == q_again["cached_tokens"] == 0  # recomputed
        assert p_again["token_ids"] == runs.cold_p["token_ids"]
        assert q_again["token_ids"] == runs.warm_q["token_ids"]
        # Counted in what A logged from its last prompt with the fleet up on: the fleet
        # stopped while A was paused, and the connector's heartbeats (one per half) find
        # the gateway unreachable then, before A resumes.
        assert f"{RESUMED} 2" in runs.a_log
        after_stop = runs.a_log.split(f"{RESUMED} 1")[-1]
        warnings = [
            line
            for line in after_stop.splitlines()
            if "unreachable" in line and not line.startswith("DEBUG")  # A logs at DEBUG
        ]
        assert 1 <= len(warnings) <= 2, after_stop[-3000:]
