"""The reorder plan through real, unmodified vLLM: documents in a new order served from kvmesh.

One ``kvmesh node`` and one ``vllm serve`` with kvmesh's connector (vLLM's own
prefix cache off, so every cached token came from kvmesh). A prompt of system +
documents 0, 1, 2 + a question is served and stored. A second prompt brings
the same documents as 2, 0, 1 with another question: as given it reuses
nothing (the first document moved), while :func:`plan_order` puts them back in
the stored order and vLLM then serves the whole documents' prefix from kvmesh.
The warm answer is checked against the same prompt computed cold (another
cache salt) by top-k logprobs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.connector.reorder import plan_order
from kvmesh.engine.vllm.worker import engine_env, transfer_config
from kvmesh.gateway.client import GatewayClient
from tests.e2e.with_vllm.support import (
    assert_same_completion,
    complete,
    healthy,
    resident_chunks,
    stop_group,
)
from tests.support.harness import REPO_ROOT
from tests.support.ports import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CHUNK = 128  # vLLM's CPU block size: kvmesh's chunk may be as small
SYSTEM, DOC, QUESTION = 40, 400, 20


def _cached(answer: dict[str, object]) -> int:
    usage = answer["usage"]
    assert isinstance(usage, dict)
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_the_reorder_plan_turns_moved_documents_into_a_prefix_hit(
    tiny_model: Path, tmp_path: Path
) -> None:
    port, http = free_port(), free_port()
    ready = tmp_path / "node.ready"
    node_log = (tmp_path / "node.log").open("w")
    node = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "node", "--host", "127.0.0.1", "--port", str(port),
         "--metrics-port", "-1", "--l1-size-bytes", "256MiB", "--l2", "none",
         "--chunk-size", str(CHUNK), "--data-dir", str(tmp_path / "node"),
         "--shm-dir", str(tmp_path), "--ready-file", str(ready)],
        cwd=REPO_ROOT, stdout=node_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    gateway = f"127.0.0.1:{port}"
    vllm_log = (tmp_path / "vllm.log").open("w")
    vllm = None
    try:
        wait_until(lambda: ready.exists() or node.poll() is not None, 60)
        assert node.poll() is None, (tmp_path / "node.log").read_text()[-3000:]
        model = str(tiny_model)
        vllm = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--port", str(http), "--host", "127.0.0.1", "--enforce-eager",
             "--no-enable-prefix-caching", "--max-model-len", "4096",
             "--enable-prompt-tokens-details",
             "--kv-transfer-config", json.dumps(transfer_config(gateway))],
            env={**os.environ, **engine_env(1)},
            stdout=vllm_log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        base = f"http://127.0.0.1:{http}"
        wait_until(lambda: healthy(base) or vllm.poll() is not None, 300)
        assert vllm.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]

        rng = random.Random(31)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, 32000) for _ in range(n)]

        system, docs = tokens(SYSTEM), [tokens(DOC) for _ in range(3)]
        first = system + docs[0] + docs[1] + docs[2] + tokens(QUESTION)
        complete(base, model, first)
        held = (SYSTEM + 3 * DOC) // CHUNK
        wait_until(lambda: resident_chunks(gateway) >= held, 60)

        question = tokens(QUESTION)
        given = [docs[2], docs[0], docs[1]]

        client = GatewayClient(gateway)
        try:
            plan = plan_order(client, model_name=model, system=system, documents=given)
        finally:
            client.close()
        assert plan.order == [1, 2, 0], plan
        assert plan.cached_tokens == held * CHUNK
        assert plan.lookups == 6  # every order of three documents
        reordered = system + [t for i in plan.order for t in given[i]] + question
        warm = complete(base, model, reordered)
        served = _cached(warm)
        assert served == held * CHUNK
        doc_share = (served - SYSTEM) / (3 * DOC)
        print(f"\nreorder: {served} of {len(reordered)} prompt tokens from kvmesh, "
              f"{doc_share:.0%} of the document tokens, {plan.lookups} lookups")  # fmt: skip
        assert doc_share >= 0.9
        cold = complete(base, model, reordered, cache_salt="cold")
        assert _cached(cold) == 0
        assert_same_completion(cold, warm)
        # Without the plan nothing past the system prompt is reused (the first document
        # moved). Last: vLLM stores this order too, after which it would be a hit.
        as_given = system + [t for d in given for t in d] + question
        assert _cached(complete(base, model, as_given)) == 0
    finally:
        if vllm is not None:
            stop_group(vllm)
        node.terminate()
        node.wait(30)
        node_log.close()
        vllm_log.close()
