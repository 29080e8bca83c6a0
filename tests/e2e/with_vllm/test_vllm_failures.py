"""kvmesh going away never hurts vLLM: it keeps answering, by recomputing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvmesh.engine.vllm.runner import results_and_log, start_engine
from tests.e2e.support import start_fleet
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def prompt(seed: int, n: int = 2000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


def test_kvmesh_stopped_mid_run_vllm_still_answers(tiny_model: Path, tmp_path: Path) -> None:
    fleet = start_fleet(tmp_path / "fleet")
    p, r = prompt(11), prompt(12)
    pause = tmp_path / "pause"
    engine = start_engine(
        {
            "model": str(tiny_model),
            "prompts": [p, p, r],
            "max_tokens": 2,
            "gateway": fleet.endpoint("node-0-gateway"),
            # Small deadlines: a test need not wait out the 5 s default.
            "connector": {"rpc_timeout_s": 1.0},
            "pause_before": {"index": 1, "path": str(pause)},
        }
    )
    try:
        wait_until(lambda: Path(f"{pause}.ready").exists() or engine.poll() is not None, 300)
        assert engine.poll() is None, "vLLM exited before the pause"
    finally:
        fleet.stop()  # kvmesh goes away while vLLM runs
    Path(f"{pause}.go").touch()
    (first, again, other), log = results_and_log(engine)

    assert first["cached_tokens"] == 0
    assert again["cached_tokens"] == 0  # nothing to load from: recomputed
    assert again["token_ids"] == first["token_ids"]
    assert len(other["token_ids"]) == 2
    # One clear warning per vLLM process (scheduler, worker) when the gateway went
    # away, not one per request.
    warnings = [line for line in log.splitlines() if "unreachable" in line]
    pids = [line.split("[kvmesh pid=")[1].split("]")[0] for line in warnings]
    assert warnings, log[-3000:]
    assert len(pids) == len(set(pids)) <= 2, log[-3000:]
