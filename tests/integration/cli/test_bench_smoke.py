"""The benchmarks run, end to end, at a tiny size: they start what they measure and report it.

Figures are not checked (tests never assert times); the keys the issues ask
for, the parameters and the same-run baselines are, and so is the clean-up
(no file left in the shared-memory directory a run was given).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import kvmesh_cli


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"kvmesh-bench-smoke-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    try:
        yield path
    finally:
        leftovers = sorted(p.name for p in path.iterdir())
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
        assert leftovers == [], f"the benchmark left files behind: {leftovers}"


def bench_json(*args: str) -> dict[str, Any]:
    done = kvmesh_cli("bench", *args, "--json", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_bench_lookup_reports_every_arrangement_and_the_issue_keys(shm_dir: Path) -> None:
    result = bench_json(
        "lookup", "--iterations", "30", "--warmup", "5", "--chunks", "4", "--shm-dir", str(shm_dir)
    )
    for key in ("lookup_p50_ms", "lookup_p99_ms", "empty_rtt_p50_ms", "chunks", "parameters"):
        assert key in result
    assert result["chunks"] == 4
    assert result["headline_arrangement"] == "node-lane"
    assert set(result["arrangements"]) == {
        "node-lane",
        "node",
        "processes-lane",
        "processes",
        "in-process",
    }
    for figures in result["arrangements"].values():
        for op in ("lookup", "end_session", "relookup", "get_chunk_size", "ping"):
            assert 0 < figures[op]["p50_ms"] <= figures[op]["max_ms"]
        # The servers' own metrics explain the round trips (they counted the calls).
        assert figures["server_mean_ms"]["gateway"]["Lookup"] > 0
    assert "local lane" in result["parameters"]["transport"]


def test_bench_datapath_reports_the_same_run_copy_limit(shm_dir: Path) -> None:
    result = bench_json(
        "datapath",
        "--chunks", "2",
        "--repetitions", "2",
        "--chunk-tokens", "16",
        "--num-layers", "2",
        "--kv-heads", "1",
        "--head-dim", "8",
        "--block-size", "16",
        "--shm-dir", str(shm_dir),
    )  # fmt: skip
    for key in ("store_gbps", "retrieve_gbps", "memcpy_gbps", "store_ratio", "retrieve_ratio"):
        assert key in result
    assert result["memcpy_gbps"] > 0
    assert result["parameters"]["store_copy_threads"] == 1  # as a node runs its stores
    assert result["chunk_bytes"] == 2 * 2 * 16 * 1 * 8 * 2  # K and V, layers, tokens, heads, dim
    assert result["chunks"] == 2
    assert result["parameters"]["block_size"] == 16


def test_bench_score_scores_the_engine_that_holds_the_prompt_while_events_flow() -> None:
    result = bench_json(
        "score", "--engines", "4", "--prompts", "2", "--calls", "50", "--prompt-tokens", "2048",
        "--shared-tokens", "512", "--rate", "20",
    )  # fmt: skip
    for key in ("score_p50_ms", "score_p99_ms", "empty_rpc", "in_process", "score_by_hashes"):
        assert key in result
    assert result["answers_correct"]
    assert result["top_engine"] == "engine-02"
    assert result["top_engine_matched_tokens"] == 2048
    assert result["chunks"] == 8
    assert result["applied_batches_per_s"] > 0
    assert result["calls"] >= 50
    assert 0 < result["score_p50_ms"] <= result["score_max_ms"]
