"""``kvmesh bench serve``: vLLM's OpenAI server under a multi-document QA workload.

The workload operators run: N documents of L tokens, each asked about once
(the warm-up round, in order) and asked again with another question (the
query round, in another order), C requests in flight, more documents than
vLLM's own KV cache holds. Three arrangements, one after the other in one run,
each a fresh vLLM server started as the README's production recipe starts it
(vLLM's prefix caching on):

- ``vllm_alone``: vLLM with a KV cache of ``--cache-docs`` documents;
- ``floor``: vLLM with a KV cache that holds every document (the best a
  cache could do: every repeated document is vLLM's own hit);
- ``kvmesh``: vLLM with the small cache and kvmesh's connector, beside a
  ``kvmesh node``.

Per arrangement: mean, p50 and p90 TTFT of each round, the longest warm-up
TTFT, each round's time, prompt tokens vLLM reported cached, preemptions;
for kvmesh also the tokens it served, the bytes it stored against the unique
prompt chunks' bytes, and the node's CPU seconds. Each server first answers
one prompt of its own outside the rounds (a process's first request is
slower), and kvmesh's counters are read around the rounds only.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.bench import node_figures
from kvmesh.bench.common import (
    Progress,
    add_connector_option_argument,
    add_model_argument,
    connector_options,
)
from kvmesh.bench.serve.client import Answer, run_round, stream_completion, ttft_summary
from kvmesh.bench.serve.servers import (
    ABANDON_GRACE_S,
    STOP_GRACE_S,
    Node,
    Server,
    metrics,
    model_shape,
    start_node,
    start_vllm,
)
from kvmesh.common.hashing import TokenHasher
from kvmesh.common.model_store import resolve as resolve_model
from kvmesh.engine.vllm.model import make_tiny_model

ARRANGEMENTS = ("vllm_alone", "floor", "kvmesh")
CHUNK = 256
QUESTION_TOKENS = 24


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmesh bench serve``."""
    add_model_argument(parser)
    parser.add_argument("--documents", type=int, default=20, help="documents (N)")
    parser.add_argument("--doc-tokens", type=int, default=6145, help="tokens per document (L)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight (C)")
    parser.add_argument(
        "--cache-docs",
        type=float,
        default=2.6,
        help="documents vLLM's own KV cache holds in vllm_alone and kvmesh",
    )
    parser.add_argument("--output-tokens", type=int, default=4, help="tokens per answer")
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's KV block size")
    parser.add_argument("--l1-size", default="4GiB", help="the kvmesh node's L1 size")
    parser.add_argument(
        "--arrangements",
        default=",".join(ARRANGEMENTS),
        help="which arrangements to run, comma-separated",
    )
    cores = os.cpu_count() or 1
    parser.add_argument(
        "--omp-bind",
        default="0" if cores <= 2 else f"0-{cores - 2}",
        help="VLLM_CPU_OMP_THREADS_BIND of every arrangement: the cores vLLM's threads run on "
        "(the default leaves one core to kvmesh and the client, in every arrangement alike; "
        "vLLM's OpenMP threads spin, so a process sharing their cores stalls every step)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of documents and questions")
    add_connector_option_argument(parser)


def _workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up prompts in order, query prompts in the query round's order)."""
    rng = random.Random(args.seed)
    docs = [
        [rng.randrange(3, 30000) for _ in range(args.doc_tokens)] for _ in range(args.documents)
    ]

    def question() -> list[int]:
        return [rng.randrange(3, 30000) for _ in range(QUESTION_TOKENS)]

    warmup = [doc + question() for doc in docs]
    order = list(range(args.documents))
    rng.shuffle(order)
    queries = [docs[i] + question() for i in order]
    return warmup, queries


def _unique_chunks(prompts: Sequence[Sequence[int]]) -> int:
    """Complete chunks of the prompts, counted once per distinct prefix (what a cache keeps)."""
    hasher = TokenHasher(CHUNK)
    seen: set[bytes] = set()
    for prompt in prompts:
        seen.update(hasher.hash_chunks(np.asarray(prompt, dtype=np.uint32)))
    return len(seen)


def _run_rounds(
    args: argparse.Namespace,
    name: str,
    server: Server,
    rounds: dict[str, list[list[int]]],
    progress: Progress,
) -> dict[str, dict[str, float]]:
    out = {}
    for label, prompts in rounds.items():
        progress.phase(f"{name}: {label} round", len(prompts), "answered")
        answered = 0

        def send(i: int, prompts: list[list[int]] = prompts) -> tuple[float, float, int]:
            return stream_completion(
                "127.0.0.1", server.port, "bench", prompts[i], args.output_tokens, 600
            )

        def show(a: Answer, label: str = label) -> None:
            nonlocal answered
            answered += 1
            progress.count(answered)
            progress.say(f"{name}: {label} {a.index + 1}: TTFT {1e3 * a.ttft_s:.0f} ms")

        before = metrics(server.metrics_url)
        answers, elapsed = run_round(send, len(prompts), args.concurrency, show)
        out[label] = {
            **ttft_summary(answers, elapsed),
            **_phases(before, metrics(server.metrics_url)),
        }
    return out


#: vLLM's per-request histograms that split a TTFT: waiting to be scheduled (the
#: connector's lookup included), then scheduled until the first token (the load
#: from kvmesh and the forward pass).
PHASES = {
    "queue_ms_mean": "vllm:request_queue_time_seconds",
    "prefill_ms_mean": "vllm:request_prefill_time_seconds",
}


def _phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per request of each of :data:`PHASES` over a round."""
    out = {}
    for key, series in PHASES.items():
        count = after.get(f"{series}_count", 0.0) - before.get(f"{series}_count", 0.0)
        total = after.get(f"{series}_sum", 0.0) - before.get(f"{series}_sum", 0.0)
        out[key] = round(1e3 * total / count, 1) if count else 0.0
    return out


def _arrangement(
    args: argparse.Namespace,
    name: str,
    model: Path,
    shape: dict[str, int],
    rounds: dict[str, list[list[int]]],
    work: Path,
    progress: Progress,
) -> dict[str, Any]:
    prompt_tokens = args.doc_tokens + QUESTION_TOKENS + args.output_tokens
    blocks_per_prompt = math.ceil(prompt_tokens / args.block_size)
    if name == "floor":
        blocks = (args.documents + args.concurrency + 1) * blocks_per_prompt
    else:
        blocks = max(
            math.ceil(args.cache_docs * args.doc_tokens / args.block_size),
            args.concurrency * blocks_per_prompt,
        )
    block_bytes = shape["kv_bytes_per_token"] * args.block_size
    gib = max(1, math.ceil(blocks * block_bytes * 1.1 / 2**30))
    node: Node | None = None
    server: Server | None = None
    abandoned = True
    try:
        if name == "kvmesh":
            progress.phase("kvmesh: starting a kvmesh node")
            node = start_node(work, args.l1_size, CHUNK)
        progress.phase(f"{name}: starting vLLM ({blocks} KV blocks of {args.block_size} tokens)")
        server = start_vllm(
            work,
            name,
            model,
            kv_blocks=blocks,
            kv_cache_gib=gib,
            block_size=args.block_size,
            max_model_len=min(shape["context"], 2 * prompt_tokens),
            gateway=node.lane if node else None,
            omp_bind=args.omp_bind,
            connector=connector_options(args.connector_option),
        )
        # The process's first request, outside the rounds and their counters, shares
        # nothing with them (a process's first request is slower).
        rng = random.Random(args.seed + 7919)
        first = [rng.randrange(3, 30000) for _ in range(args.doc_tokens)]
        stream_completion("127.0.0.1", server.port, "bench", first, 1, 600)
        if node is not None:
            time.sleep(1.0)  # its stores land before the counters are read
        before = node.counters() if node else {}
        node_before = node_figures.scrape([node.metrics_url]) if node else {}
        cpu_before = node.cpu_seconds() if node else 0.0
        vllm_before = _preemptions(server)
        summaries = _run_rounds(args, name, server, rounds, progress)
        result: dict[str, Any] = {
            "kv_blocks": blocks,
            "warmup_ttft_mean_ms": summaries["warmup"]["ttft_mean_ms"],
            "warmup_ttft_p50_ms": summaries["warmup"]["ttft_p50_ms"],
            "warmup_ttft_p90_ms": summaries["warmup"]["ttft_p90_ms"],
            "warmup_ttft_max_ms": summaries["warmup"]["ttft_max_ms"],
            "warmup_round_s": summaries["warmup"]["round_s"],
            "query_ttft_mean_ms": summaries["query"]["ttft_mean_ms"],
            "query_ttft_p50_ms": summaries["query"]["ttft_p50_ms"],
            "query_ttft_p90_ms": summaries["query"]["ttft_p90_ms"],
            "query_ttft_max_ms": summaries["query"]["ttft_max_ms"],
            "query_round_s": summaries["query"]["round_s"],
            # TTFT split by vLLM's own request timings (queue, then prefill).
            "warmup_queue_ms_mean": summaries["warmup"]["queue_ms_mean"],
            "warmup_prefill_ms_mean": summaries["warmup"]["prefill_ms_mean"],
            "query_queue_ms_mean": summaries["query"]["queue_ms_mean"],
            "query_prefill_ms_mean": summaries["query"]["prefill_ms_mean"],
            "cached_tokens": summaries["warmup"]["cached_tokens"]
            + summaries["query"]["cached_tokens"],
            "preemptions": _preemptions(server) - vllm_before,
        }
        if node is not None:
            # Stores finish in the background after the answers: let them land.
            time.sleep(2.0)
            after = node.counters()

            def delta(series: str) -> float:
                return after.get(series, 0.0) - before.get(series, 0.0)

            chunk_bytes = shape["kv_bytes_per_token"] * CHUNK
            result.update(
                {
                    "tokens_from_kvmesh": int(delta("kvmesh_gateway_retrieved_chunks_total"))
                    * CHUNK,
                    "stored_chunks": int(delta("kvmesh_gateway_stored_chunks_total")),
                    "stored_bytes": int(delta("kvmesh_gateway_stored_chunks_total")) * chunk_bytes,
                    "store_skipped_chunks": int(delta("kvmesh_gateway_store_skipped_chunks_total")),
                    "kvmesh_cpu_s": round(node.cpu_seconds() - cpu_before, 2),
                    # L1 grows while the rounds run: how many store calls waited for a
                    # new segment, the longest wait since the node started, and segments.
                    "l1_growth_waits": int(delta("kvmesh_storage_l1_growth_waits_total")),
                    "l1_growth_wait_max_ms": round(
                        1e3 * after.get("kvmesh_storage_l1_growth_wait_max_seconds", 0.0), 1
                    ),
                    "l1_segments": int(after.get("kvmesh_storage_l1_segments", 0)),
                    # The node's handlers and copies over both rounds (retrieves are the
                    # query round's loads, stores the warm-up's): bench/node_figures.py.
                    "node": node_figures.figures(
                        node_before, node_figures.scrape([node.metrics_url])
                    ),
                }
            )
        abandoned = False
        return result
    finally:
        grace = ABANDON_GRACE_S if abandoned else STOP_GRACE_S
        if server is not None:
            server.process.stop(grace)
        if node is not None:
            node.process.stop(grace)


def _preemptions(server: Server) -> int:
    return int(metrics(server.metrics_url).get("vllm:num_preemptions_total", 0.0))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen arrangements; one JSON-ready dict."""
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("kvmesh bench serve: vLLM is not installed (pip install 'kvmesh[vllm]')")
    chosen = [a.strip() for a in args.arrangements.split(",") if a.strip()]
    unknown = sorted(set(chosen) - set(ARRANGEMENTS))
    if unknown or not chosen:
        raise SystemExit(f"kvmesh bench serve: --arrangements takes {', '.join(ARRANGEMENTS)}")
    if args.documents < 1 or args.doc_tokens < CHUNK or args.concurrency < 1:
        raise SystemExit(
            f"kvmesh bench serve: --documents and --concurrency >= 1, --doc-tokens >= {CHUNK}"
        )
    with (
        tempfile.TemporaryDirectory(prefix="kvmesh-bench-serve-") as tmp,
        Progress.for_args("serve", args) as progress,
    ):
        work = Path(tmp)
        progress.phase("making the model's folder")
        model = resolve_model(args.model) if args.model else make_tiny_model(work / "model")
        shape = model_shape(model)
        warmup, queries = _workload(args)
        rounds = {"warmup": warmup, "query": queries}
        unique_bytes = _unique_chunks(warmup + queries) * shape["kv_bytes_per_token"] * CHUNK
        arrangements = {}
        for name in chosen:
            arrangements[name] = _arrangement(args, name, model, shape, rounds, work, progress)
    result: dict[str, Any] = {
        "benchmark": "serve",
        "model": args.model or "tiny random-weight Llama (kvmesh.engine.vllm.model)",
        "kv_bytes_per_token": shape["kv_bytes_per_token"],
        "workload": {
            "documents": args.documents,
            "doc_tokens": args.doc_tokens,
            "question_tokens": QUESTION_TOKENS,
            "concurrency": args.concurrency,
            "cache_docs": args.cache_docs,
            "output_tokens": args.output_tokens,
            "omp_bind": args.omp_bind,
        },
        "connector_options": connector_options(args.connector_option),
        "arrangements": arrangements,
        "unique_prompt_bytes": unique_bytes,
    }
    mesh = arrangements.get("kvmesh")
    if mesh is not None:
        result["stored_bytes"] = mesh["stored_bytes"]
        result["stored_vs_unique"] = round(mesh["stored_bytes"] / unique_bytes, 3)
    floor, alone = arrangements.get("floor"), arrangements.get("vllm_alone")
    if mesh and floor:
        result["query_ttft_vs_floor"] = round(
            mesh["query_ttft_mean_ms"] / floor["query_ttft_mean_ms"], 3
        )
    if mesh and alone:
        result["warmup_round_vs_vllm_alone"] = round(
            mesh["warmup_round_s"] / alone["warmup_round_s"], 3
        )
    return result


def format_table(result: dict[str, Any]) -> str:
    """The figures as a table (only what this run measured)."""
    w = result["workload"]
    lines = [
        f"kvmesh bench serve: {result['model']}; {w['documents']} documents of "
        f"{w['doc_tokens']} tokens, asked twice, {w['concurrency']} in flight, vLLM's cache "
        f"holding {w['cache_docs']} documents (except floor)",
        f"{'arrangement':<12} {'query mean':>10} {'p50':>8} {'p90':>8} {'warm-up mean':>13} "
        f"{'max':>8} {'warm-up s':>10} {'query s':>8} {'preempt':>8}",
    ]
    for name, a in result["arrangements"].items():
        lines.append(
            f"{name:<12} {a['query_ttft_mean_ms']:>8.1f}ms {a['query_ttft_p50_ms']:>6.1f}ms "
            f"{a['query_ttft_p90_ms']:>6.1f}ms {a['warmup_ttft_mean_ms']:>11.1f}ms "
            f"{a['warmup_ttft_max_ms']:>6.1f}ms {a['warmup_round_s']:>10.2f} "
            f"{a['query_round_s']:>8.2f} {a['preemptions']:>8}"
        )
    mesh = result["arrangements"].get("kvmesh")
    if mesh:
        lines.append(
            f"kvmesh: {mesh['tokens_from_kvmesh']} tokens served, {mesh['stored_bytes']} bytes "
            f"stored for {result['unique_prompt_bytes']} unique prompt bytes "
            f"({result['stored_vs_unique']}x), {mesh['kvmesh_cpu_s']} CPU s; "
            f"L1 {mesh['l1_segments']} segments, {mesh['l1_growth_waits']} store calls waited "
            f"for a growth, the longest {mesh['l1_growth_wait_max_ms']} ms"
        )
        lines.append(f"kvmesh: {node_figures.describe(mesh['node'])}")
    for key in ("query_ttft_vs_floor", "warmup_round_vs_vllm_alone"):
        if key in result:
            lines.append(f"{key}: {result[key]}")
    return "\n".join(lines)
