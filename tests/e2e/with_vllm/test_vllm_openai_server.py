"""vLLM's OpenAI server, started with ``--kv-transfer-config``, serves a prompt from kvmesh."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvmesh.engine.vllm.worker import engine_env, transfer_config
from tests.e2e.support import start_fleet
from tests.e2e.with_vllm.support import (
    assert_same_completion,
    complete,
    resident_chunks,
    stop_group,
)
from tests.support.ports import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 3000
CACHED = PROMPT_TOKENS // 256 * 256


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def test_openai_server_with_kv_transfer_config_serves_a_prompt_from_kvmesh(
    tiny_model: Path, tmp_path: Path
) -> None:
    fleet = start_fleet(tmp_path / "fleet")
    port = free_port()
    config = transfer_config(fleet.endpoint("node-0-gateway"))
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model), "--port", str(port), "--host", "127.0.0.1",
        "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "16384",
        "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            command,
            env={**os.environ, **engine_env(1)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _get(f"{base}/health") or server.poll() is not None, 300)
        assert server.poll() is None, log.read_text()[-3000:]
        rng = random.Random(5)
        prompt = [rng.randrange(3, 32000) for _ in range(PROMPT_TOKENS)]
        cold = complete(base, str(tiny_model), prompt, max_tokens=1)
        # vLLM answers before the connector's stores finish (they run in the background):
        # the next request finds the prefix once the node holds its chunks.
        storage = fleet.endpoint("node-0-storage")
        wait_until(lambda: resident_chunks(storage) >= CACHED // 256, 60)
        warm = complete(base, str(tiny_model), prompt, max_tokens=1)
        # The request's own switches (docs/vllm.md, "Per-request switches"): not looked
        # up, the same prompt is computed; not stored, a prompt is not found later.
        unasked = complete(
            base, str(tiny_model), prompt, max_tokens=1, kv_transfer_params=OFF["lookup"]
        )
        private, other = ([rng.randrange(3, 32000) for _ in range(PROMPT_TOKENS)] for _ in range(2))
        complete(base, str(tiny_model), private, max_tokens=1, kv_transfer_params=OFF["store"])
        complete(base, str(tiny_model), other, max_tokens=1)
        # The later prompt's stores are done, and the node holds its chunks and the
        # first prompt's, and nothing of the private one.
        wait_until(lambda: resident_chunks(storage) >= 2 * CACHED // 256, 60)
        assert resident_chunks(storage) == 2 * CACHED // 256
        private_again = complete(base, str(tiny_model), private, max_tokens=1)
    finally:
        stop_group(server)
        fleet.stop()
    assert_same_completion(cold, warm)
    assert cached_tokens(warm) == CACHED, warm["usage"]
    assert_same_completion(cold, unasked)
    assert cached_tokens(unasked) == 0, unasked["usage"]
    assert cached_tokens(private_again) == 0, private_again["usage"]


OFF = {switch: {"kvmesh": {switch: False}} for switch in ("lookup", "store")}


def cached_tokens(answer: dict[str, Any]) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
