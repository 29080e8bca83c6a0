"""``kvmesh bench route --json`` end to end, small: two real vLLM servers, two nodes, a coordinator.

The figures themselves are not asserted (speed is read off the benchmark,
never a test); what the JSON promises is: every router's keys, every request
answered, the oracle finding more cached tokens than round robin, the score
router finding cached prefixes through ScoreEngines with every call
answered, and progress on stderr with stdout one JSON object.
"""

from __future__ import annotations

import json

import pytest

from tests.support.harness import kvmesh_cli
from tests.support.servers import require_vllm

pytestmark = pytest.mark.slow

GROUPS, PER_GROUP, PREFIX = 3, 3, 512
KEYS = (
    "hit_tokens",
    "prompt_tokens",
    "hit_rate",
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "requests_per_engine",
)


def test_bench_route_compares_score_round_robin_and_oracle() -> None:
    require_vllm()
    done = kvmesh_cli(
        "bench", "route", "--groups", str(GROUPS), "--requests-per-group", str(PER_GROUP),
        "--prefix-tokens", str(PREFIX), "--suffix-tokens", "32", "--output-tokens", "2",
        "--json", timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-8000:]
    result = json.loads(done.stdout)
    assert result["model"]
    assert len(result["engines"]) == 2
    assert result["workload"]["requests"] == GROUPS * PER_GROUP
    routers = result["routers"]
    assert list(routers) == ["score", "round_robin", "oracle"]
    for name, figures in routers.items():
        assert all(key in figures for key in KEYS), (name, figures)
        assert figures["answered"] == figures["requests"] == GROUPS * PER_GROUP, (name, figures)
        assert sum(figures["requests_per_engine"].values()) == GROUPS * PER_GROUP
        assert figures["prompt_tokens"] == GROUPS * PER_GROUP * (PREFIX + 32)
    # Round robin sends some follow-ups where their prefix is not; the oracle never does.
    assert routers["oracle"]["hit_tokens"] > routers["round_robin"]["hit_tokens"]
    assert routers["oracle"]["hit_tokens"] <= result["workload"]["reusable_tokens"]
    score = routers["score"]
    assert score["hit_tokens"] > 0
    assert score["score_calls"] == GROUPS * PER_GROUP
    assert score["score_failed"] == 0
    assert score["score_informed"] > 0
    assert result["score_p99_ms"] is not None
    assert result["score_vs_oracle_hit_ratio"] is not None
    assert "route: score: routing" in done.stderr
    assert "route: done in" in done.stderr
