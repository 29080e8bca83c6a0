"""vLLM clears its caches (as around a weight update): kvmesh never hands back older KV.

One vLLM process (its own prefix cache off, so every cached token came from
kvmesh) answers the same prompt four times: cold (kvmesh stores it), warm
(loaded from kvmesh), then after ``LLM.reset_prefix_cache(reset_connector=True)``
cold again (what kvmesh held from before the reset is not found) and warm again
(stored after the reset, in the engine's new key namespace). See docs/vllm.md,
"Cache resets".
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvmesh.engine.vllm.runner import kill, results, resume, start_engine
from tests.e2e.support import start_fleet
from tests.e2e.with_vllm.support import resident_chunks
from tests.e2e.with_vllm.test_vllm_connector import wait_paused
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CHUNK = 256
TOKENS = 1100
WHOLE = TOKENS // CHUNK  # complete chunks of the prompt


def test_after_vllm_resets_its_caches_kvmesh_hands_back_nothing_from_before(
    tiny_model: Path, tmp_path: Path
) -> None:
    prompt = [random.Random(5).randrange(3, 32000) for _ in range(TOKENS)]
    fleet = start_fleet(tmp_path / "fleet")
    storage = fleet.endpoint("node-0-storage")
    stored, stored_again = tmp_path / "stored", tmp_path / "stored-again"
    engine = start_engine(
        {
            "model": str(tiny_model),
            "prompts": [prompt] * 5,
            # The last run switches kvmesh's lookup off for itself (docs/vllm.md,
            # "Per-request switches"), offline, through SamplingParams.extra_args.
            "kv_transfer_params": [None] * 4 + [{"kvmesh": {"lookup": False}}],
            "one_process": True,
            "gateway": fleet.endpoint("node-0-gateway"),
            "pause_before": [
                {"index": 1, "path": str(stored)},
                {"index": 3, "path": str(stored_again)},
            ],
            "reset_before": [2],
        }
    )
    try:
        wait_paused(engine, stored)
        wait_until(lambda: resident_chunks(storage) >= WHOLE, 60)
        resume(stored)
        wait_paused(engine, stored_again)
        # The prompt is stored a second time, under the new namespace's keys.
        wait_until(lambda: resident_chunks(storage) >= 2 * WHOLE, 60)
        resume(stored_again)
        runs = results(engine)
    finally:
        kill(engine)
        fleet.stop()
    cold, warm, reset, after, again, unasked = runs
    assert reset == {"reset": True}
    assert cold["cached_tokens"] == 0
    assert warm["cached_tokens"] >= (WHOLE - 1) * CHUNK, warm
    assert after["cached_tokens"] == 0, "KV from before the reset was loaded"
    assert again["cached_tokens"] >= (WHOLE - 1) * CHUNK, again
    assert unasked["cached_tokens"] == 0, unasked
