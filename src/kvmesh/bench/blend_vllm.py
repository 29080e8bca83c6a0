"""The ``reorder_vllm`` arrangement of ``kvmesh bench blend``: the reorder plan through vLLM.

Unmodified vLLM (its OpenAI server, kvmesh's connector on a ``kvmesh node``'s
lane, vLLM's own prefix cache off so every reused token came from kvmesh) gets
the benchmark's prompts. For each prompt, first an earlier request brings the
same documents in another random order with another question, which vLLM
computes and kvmesh stores. Then the prompt itself: its documents in their
order are planned (kvmesh.connector.reorder, the plan's lookups timed as part
of the TTFT) and sent in the planned order.

The reference is vLLM's own full prefill of the prompt in its given order
(under a cache salt nothing else uses, so nothing is reused): its TTFT for the
speedup, and its greedy tokens for the agreement, which measures what the new
order does to the answer. ``greedy_agreement_reordered_cold`` compares with
the reordered prompt computed cold instead: what kvmesh's reuse alone
changes. vLLM gives top-k logprobs only, so no first-token KL divergence is
reported for this arrangement. ``answer_accuracy`` and ``answer_agreement``
read the answer the generated text gives, as for the engine's arrangements.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvmesh.bench.common import Progress
from kvmesh.bench.serve.servers import (
    ABANDON_GRACE_S,
    STOP_GRACE_S,
    launch_vllm,
    start_node,
    wait_serving,
)
from kvmesh.connector.reorder import plan_order
from kvmesh.gateway.client import GatewayClient

#: vLLM's KV block size and kvmesh's chunk size here: short documents waste less at
#: the chunk boundary where the question starts than with 256-token chunks.
CHUNK = 64
#: The name vLLM serves the model under (kvmesh.bench.serve.servers.launch_vllm).
SERVED_NAME = "bench"


def _stream(
    port: int, prompt: Sequence[int], max_tokens: int, cache_salt: str = ""
) -> tuple[float, list[str], int]:
    """One streamed greedy completion: (TTFT s, the generated tokens, cached prompt tokens)."""
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.perf_counter()
    first: float | None = None
    tokens: list[str] = []
    cached = 0
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"vLLM answered HTTP {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event: dict[str, Any] = json.loads(line[5:])
            for choice in event.get("choices") or []:
                if first is None:
                    first = time.perf_counter()
                tokens += (choice.get("logprobs") or {}).get("tokens") or []
            details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or cached)
    finally:
        connection.close()
    return (first or time.perf_counter()) - start, tokens, cached


def measure_reorder(
    folder: Path,
    system: list[int],
    workload: tuple[Sequence[tuple[list[list[int]], list[int]]], Sequence[str]],
    answer_of: Callable[[str], str | None],
    args: argparse.Namespace,
    progress: Progress,
) -> dict[str, list[float]]:
    """Per figure, one value per prompt (see the module's docstring).

    ``workload`` is the prompts and the answer each asks for; ``answer_of`` reads
    the answer a generated text gives (None where it gives none)."""
    prompts, answers = workload
    work = Path(tempfile.mkdtemp(prefix="kvmesh-bench-blend-vllm-"))
    rng = random.Random(args.seed + 2)
    figures: dict[str, list[float]] = {}
    node = server = None
    abandoned = True
    try:
        progress.phase("reorder_vllm: starting a kvmesh node and vLLM")
        node = start_node(work, "1GiB", CHUNK, ["--l2", "none"])
        longest = max(len(system) + sum(map(len, d)) + len(q) for d, q in prompts)
        cores = os.cpu_count() or 1
        server = launch_vllm(
            work, "blend", folder, kv_blocks=4 * (longest // CHUNK + 2), kv_cache_gib=1,
            block_size=CHUNK, max_model_len=longest + args.generate + CHUNK,
            gateway=node.lane, omp_bind="0" if cores <= 2 else f"0-{cores - 2}",
            extra_args=["--no-enable-prefix-caching"],
        )  # fmt: skip
        wait_serving(server)
        model = str(folder)  # the connector's model_name: vLLM's --model
        client = GatewayClient(node.lane)
        try:
            progress.phase("reorder_vllm: prompts", total=len(prompts))
            for done, ((docs, question), answer) in enumerate(
                zip(prompts, answers, strict=True), 1
            ):
                earlier = rng.sample(docs, len(docs))
                other = question[::-1]  # another question after the same documents
                _stream(server.port, [*system, *(t for d in earlier for t in d), *other], 1)
                _wait_held(client, model, system, earlier)
                given = [*system, *(t for d in docs for t in d), *question]
                ref_ttft, ref_tokens, _ = _stream(
                    server.port, given, args.generate, cache_salt=f"reference-{done}"
                )
                began = time.perf_counter()
                plan = plan_order(client, model_name=model, system=system, documents=docs)
                plan_s = time.perf_counter() - began
                reordered = [*system, *(t for i in plan.order for t in docs[i]), *question]
                ttft, tokens, cached = _stream(server.port, reordered, args.generate)
                # The same reordered prompt computed cold: what kvmesh's reuse alone changes.
                _, cold_tokens, _ = _stream(
                    server.port, reordered, args.generate, cache_salt=f"reordered-{done}"
                )
                doc_tokens = sum(map(len, docs))
                agree = sum(a == b for a, b in zip(tokens, ref_tokens, strict=False))
                row = {
                    "ttft_ms": (plan_s + ttft) * 1e3,
                    "plan_ms": plan_s * 1e3,
                    "vllm_full_prefill_ttft_ms": ref_ttft * 1e3,
                    "reused_token_fraction": cached / len(reordered),
                    "doc_token_fraction": max(0, cached - len(system)) / doc_tokens,
                    "greedy_agreement": agree / args.generate,
                    "greedy_agreement_reordered_cold": sum(
                        a == b for a, b in zip(tokens, cold_tokens, strict=False)
                    )
                    / args.generate,
                    "answer_accuracy": float(answer_of("".join(tokens)) == answer),
                    "answer_agreement": float(
                        answer_of("".join(tokens)) == answer_of("".join(ref_tokens))
                    ),
                    "lookups": float(plan.lookups),
                }
                for key, value in row.items():
                    figures.setdefault(key, []).append(value)
                progress.count(done)
        finally:
            client.close()
        abandoned = False
    finally:
        grace = ABANDON_GRACE_S if abandoned else STOP_GRACE_S
        if server is not None:
            server.process.stop(grace)
        if node is not None:
            node.process.stop(grace)
        shutil.rmtree(work, ignore_errors=True)
    return figures


def _wait_held(
    client: GatewayClient,
    model: str,
    system: list[int],
    docs: list[list[int]],
    timeout_s: float = 60.0,
) -> None:
    """Wait until kvmesh holds the earlier request's documents (vLLM stores after answering)."""
    want = (len(system) + sum(map(len, docs))) // CHUNK * CHUNK
    deadline = time.monotonic() + timeout_s
    while True:
        plan = plan_order(client, model_name=model, system=system, documents=docs)
        if plan.cached_tokens >= want:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"kvmesh holds {plan.cached_tokens} of {want} tokens of a stored prompt "
                f"after {timeout_s:.0f} s"
            )
        time.sleep(0.2)


def summary(figures: dict[str, list[float]]) -> dict[str, Any]:
    """The arrangement's row of the report."""

    def mean(key: str) -> float:
        return sum(figures[key]) / len(figures[key])

    return {
        "ttft_mean_ms": round(mean("ttft_ms"), 1),
        "ttft_speedup": round(mean("vllm_full_prefill_ttft_ms") / mean("ttft_ms"), 2),
        "reused_token_fraction": round(mean("reused_token_fraction"), 4),
        "doc_token_fraction": round(mean("doc_token_fraction"), 4),
        "greedy_agreement": round(mean("greedy_agreement"), 4),
        "greedy_agreement_reordered_cold": round(mean("greedy_agreement_reordered_cold"), 4),
        "answer_accuracy": round(mean("answer_accuracy"), 4),
        "answer_agreement": round(mean("answer_agreement"), 4),
        "first_token_kl": None,
        "plan_ms_mean": round(mean("plan_ms"), 2),
        "lookups_mean": round(mean("lookups"), 1),
        "vllm_full_prefill_ttft_mean_ms": round(mean("vllm_full_prefill_ttft_ms"), 1),
        "against": "vLLM's own full prefill of the prompt in its given order (bf16)",
    }
