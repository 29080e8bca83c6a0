"""``kvmesh demo --engine vllm --nodes 2``: real vLLM, the warm run on the other node over P2P."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.engine.vllm.worker import engine_env
from tests.e2e.support import require_fleet_services

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 2048
#: Every whole chunk, less the last token's block (vLLM recomputes the last token).
FROM_CACHE = (PROMPT_TOKENS - 1) // 128 * 128


def test_vllm_demo_on_two_nodes_gets_the_prompt_over_p2p(tiny_model: Path) -> None:
    require_fleet_services()
    command = [sys.executable, "-m", "kvmesh.cli", "demo", "--engine", "vllm", "--nodes", "2",
               "--model", str(tiny_model), "--prompt-tokens", str(PROMPT_TOKENS),
               "--json", "--no-progress"]  # fmt: skip
    done = subprocess.run(
        command,
        env={**os.environ, **engine_env(1)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["parameters"]["via_p2p"] is True
    assert result["tokens_from_cache"] == FROM_CACHE, done.stderr[-5000:]
    assert result["outputs_match"] is True
