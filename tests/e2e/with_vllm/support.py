"""Helpers of the real-vLLM tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from typing import Any

from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.storage.client import StorageClient


def resident_chunks(storage: str) -> int:
    """Chunks a storage node holds in L1."""

    async def ask() -> int:
        client = StorageClient(storage)
        try:
            status = await client.get_status(storage_pb2.GetStatusRequest(), timeout=5.0)
            return int(status.l1.resident_objects)
        finally:
            await client.close()

    return asyncio.run(ask())


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGTERM to the process group of ``proc`` (started in its own session); SIGKILL
    after ``grace_s``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def healthy(base: str) -> bool:
    """Whether vLLM's OpenAI server at ``base`` answers its health check."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


#: Top-k logprobs a warm answer may differ by from a cold one: two bf16 steps of a
#: logit near 1 (2**-6). Attention over a loaded prefix sums in another order than a
#: full prefill, as with vLLM's own prefix cache; a wrong block moves the hidden state
#: far more and changes the top-k ids. See docs/architecture.md, "Checking KV integrity".
LOGPROB_TOLERANCE = 2**-6
#: Top-k logprobs each completion asks for.
TOP_K = 5


def complete(
    base: str,
    model: str,
    prompt: list[int],
    max_tokens: int = 4,
    cache_salt: str = "",
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One greedy completion of token ids by vLLM's OpenAI server, with top-k logprobs.

    ``cache_salt`` (vLLM's request field) keys the prompt's KV apart from other salts';
    ``kv_transfer_params`` (also a request field) carries the connectors' per-request
    switches.
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": TOP_K,
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200
        answer: dict[str, Any] = json.load(resp)
    return answer


def assert_same_completion(cold: dict[str, Any], warm: dict[str, Any]) -> None:
    """``warm`` answers as ``cold`` did, up to the numerics of another computation path.

    Step by step, while the greedy tokens agree: a token in both top-k lists has
    logprobs within :data:`LOGPROB_TOLERANCE`, and a token in only one list sits
    at the other's edge (a near tie for the k-th place). Where the greedy tokens
    first differ, the two must be such a near tie in both lists; the steps after
    continue two different texts and are not compared.
    """
    steps_cold = cold["choices"][0]["logprobs"]
    steps_warm = warm["choices"][0]["logprobs"]
    pairs = zip(
        steps_cold["tokens"],
        steps_warm["tokens"],
        steps_cold["top_logprobs"],
        steps_warm["top_logprobs"],
        strict=True,
    )
    for step, (token_cold, token_warm, top_cold, top_warm) in enumerate(pairs):
        where = f"step {step}: cold top-k {top_cold}, warm top-k {top_warm}"
        for token in top_cold.keys() & top_warm.keys():
            assert abs(top_cold[token] - top_warm[token]) <= LOGPROB_TOLERANCE, where
        for token in top_cold.keys() - top_warm.keys():
            assert top_cold[token] <= min(top_warm.values()) + LOGPROB_TOLERANCE, where
        for token in top_warm.keys() - top_cold.keys():
            assert top_warm[token] <= min(top_cold.values()) + LOGPROB_TOLERANCE, where
        if token_cold != token_warm:
            assert token_warm in top_cold, where
            assert token_cold in top_warm, where
            assert abs(top_cold[token_cold] - top_cold[token_warm]) <= LOGPROB_TOLERANCE, where
            assert abs(top_warm[token_cold] - top_warm[token_warm]) <= LOGPROB_TOLERANCE, where
            return
