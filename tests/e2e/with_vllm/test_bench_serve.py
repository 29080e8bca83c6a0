"""``kvmesh bench serve --json`` end to end, small: three real vLLM servers and a node,
up together while their two query rounds take turns.

The figures themselves are not asserted (speed is read off the benchmark,
never a test); what the JSON promises is: every arrangement's keys, kvmesh
serving the repeated documents, bytes stored equal to the unique prompt
chunks, and progress on stderr with stdout one JSON object.
"""

from __future__ import annotations

import json

import pytest

from tests.support.harness import kvmesh_cli
from tests.support.servers import require_vllm

pytestmark = pytest.mark.slow

KEYS = ("query_ttft_mean_ms", "warmup_ttft_max_ms", "warmup_round_s", "query_round_s")


def test_bench_serve_reports_every_arrangement() -> None:
    require_vllm()
    done = kvmesh_cli(
        "bench", "serve", "--documents", "3", "--doc-tokens", "1024", "--cache-docs", "1.5",
        "--connector-option", "load_ahead=true", "--query-rounds", "2", "--json", timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["model"]
    assert result["workload"]["query_rounds"] == 2
    for name in ("vllm_alone", "floor", "kvmesh"):
        figures = result["arrangements"][name]
        assert all(figures[key] > 0 for key in KEYS), (name, figures)
        # Both query rounds ran in every arrangement (taking turns, all servers up).
        assert len(figures["query_rounds_ttft_mean_ms"]) == 2, (name, figures)
        assert all(t > 0 for t in figures["query_rounds_ttft_mean_ms"]), (name, figures)
        # The split of a TTFT from vLLM's own request timings: a prefill always takes time.
        assert figures["query_prefill_ms_mean"] > 0, (name, figures)
        assert figures["query_queue_ms_mean"] >= 0, (name, figures)
    assert len(result["query_ttft_vs_floor_by_round"]) == 2
    # kvmesh's warm-up round against both arrangements that compute every document cold.
    warmup_s = result["arrangements"]["kvmesh"]["warmup_round_s"]
    for reference in ("vllm_alone", "floor"):
        expected = round(warmup_s / result["arrangements"][reference]["warmup_round_s"], 3)
        assert result[f"warmup_round_vs_{reference}"] == expected
    mesh = result["arrangements"]["kvmesh"]
    # Each document is 4 chunks; each query round finds at least the ones vLLM evicted.
    assert mesh["tokens_from_kvmesh"] >= 2 * 1024
    # The node's L1 figures come from its metrics (at least the first segment is mapped).
    assert mesh["l1_segments"] >= 1
    assert isinstance(mesh["l1_growth_waits"], int)
    assert isinstance(mesh["l1_growth_wait_max_ms"], float)
    assert result["stored_bytes"] == result["unique_prompt_bytes"] > 0
    # The node's own account of the calls: every load and store it served was a copy.
    node = mesh["node"]
    assert node["lookup"]["calls"] >= 6
    assert node["lookup"]["handler_ms_mean"] > 0
    for kind in ("retrieve", "store"):
        assert node[kind]["copies"] >= 1, (kind, node)
        assert node[kind]["copy_gb_s"] > 0, (kind, node)
        assert node[kind]["calls"] >= node[kind]["copies"], (kind, node)
    # load_ahead on (vLLM on CPU, one worker): its scheduler starts the loads
    # (RetrieveAhead) and the worker's Retrieve joins them; one that came late copies
    # itself.
    assert node["retrieve"]["started_ahead"] >= 1, node
    assert node["retrieve"]["joined"] <= node["retrieve"]["started_ahead"], node
    # The node's event loop was watched all along (its lag monitor woke 200 times a second).
    assert node["loop"]["wake_ups"] > 100, node
    assert 0 <= node["loop"]["late_100ms"] <= node["loop"]["late_20ms"] <= node["loop"]["wake_ups"]
    assert result["arrangements"]["floor"]["cached_tokens"] >= 3 * 1024
    assert "serve: vllm_alone: warmup round" in done.stderr
    assert "serve: kvmesh: query 2 round" in done.stderr
    assert "serve: done in" in done.stderr
