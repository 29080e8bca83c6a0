"""``kvmesh bench serve``: vLLM's OpenAI server under a multi-document QA workload.

The workload operators run: N documents of L tokens, each asked about once
(the warm-up round, in order) and asked again with another question (the
query round, in another order), C requests in flight, more documents than
vLLM's own KV cache holds. Three arrangements in one run, each a fresh vLLM
server started as the README's production recipe starts it (vLLM's prefix
caching on):

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

By default the arrangements run one after the other. With ``--query-rounds
K`` above 1 they are all started and warmed first, then their K query rounds
(each with new questions, in a new order) take turns, and the figures pool
every query round: on a VM whose speed drifts by tens of percent within
minutes, the ratio of two arrangements then compares the same minutes
(docs/benchmarks.md, "Reading `bench serve` on a noisy host").
"""

from __future__ import annotations

import argparse
import importlib.util
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
    add_node_realtime_argument,
    connector_options,
)
from kvmesh.bench.serve.arrangement import CHUNK, QUESTION_TOKENS, Arrangement
from kvmesh.bench.serve.servers import model_shape
from kvmesh.common.hashing import TokenHasher
from kvmesh.common.model_store import resolve as resolve_model
from kvmesh.engine.vllm.model import make_tiny_model

ARRANGEMENTS = ("vllm_alone", "floor", "kvmesh")
#: Pause before each query round when rounds take turns: a vLLM server that just
#: answered keeps its engine core polling its queues (``sched_yield``) for about a
#: second, which slows whatever round runs next on a 2-core host.
TURN_PAUSE_S = 3.0


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
    parser.add_argument(
        "--query-rounds",
        type=int,
        default=1,
        help="query rounds (K): with more than one, every arrangement stays up and their "
        "query rounds take turns, so a slow phase of the host falls on all of them alike",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of documents and questions")
    add_connector_option_argument(parser)
    add_node_realtime_argument(parser)


def _workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(warm-up prompts in order, each query round's prompts in its order).

    Every query round asks every document again, with a question of its own
    and in an order of its own; the first round is the same for any
    ``--query-rounds``.
    """
    rng = random.Random(args.seed)
    docs = [
        [rng.randrange(3, 30000) for _ in range(args.doc_tokens)] for _ in range(args.documents)
    ]

    def question() -> list[int]:
        return [rng.randrange(3, 30000) for _ in range(QUESTION_TOKENS)]

    warmup = [doc + question() for doc in docs]
    query_rounds = []
    for _ in range(args.query_rounds):
        order = list(range(args.documents))
        rng.shuffle(order)
        query_rounds.append([docs[i] + question() for i in order])
    return warmup, query_rounds


def _unique_chunks(prompts: Sequence[Sequence[int]]) -> int:
    """Complete chunks of the prompts, counted once per distinct prefix (what a cache keeps)."""
    hasher = TokenHasher(CHUNK)
    seen: set[bytes] = set()
    for prompt in prompts:
        seen.update(hasher.hash_chunks(np.asarray(prompt, dtype=np.uint32)))
    return len(seen)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen arrangements; one JSON-ready dict."""
    chosen = [a.strip() for a in args.arrangements.split(",") if a.strip()]
    unknown = sorted(set(chosen) - set(ARRANGEMENTS))
    if unknown or not chosen:
        raise SystemExit(f"kvmesh bench serve: --arrangements takes {', '.join(ARRANGEMENTS)}")
    if args.documents < 1 or args.doc_tokens < CHUNK or args.concurrency < 1:
        raise SystemExit(
            f"kvmesh bench serve: --documents and --concurrency >= 1, --doc-tokens >= {CHUNK}"
        )
    if args.query_rounds < 1:
        raise SystemExit("kvmesh bench serve: --query-rounds must be >= 1")
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("kvmesh bench serve: vLLM is not installed (pip install 'kvmesh[vllm]')")
    with (
        tempfile.TemporaryDirectory(prefix="kvmesh-bench-serve-") as tmp,
        Progress.for_args("serve", args) as progress,
    ):
        work = Path(tmp)
        progress.phase("making the model's folder")
        model = resolve_model(args.model) if args.model else make_tiny_model(work / "model")
        shape = model_shape(model)
        warmup, query_rounds = _workload(args)
        unique_prompts = warmup + [p for prompts in query_rounds for p in prompts]
        unique_bytes = _unique_chunks(unique_prompts) * shape["kv_bytes_per_token"] * CHUNK
        each = [Arrangement(args, name, model, shape, work, progress) for name in chosen]
        if args.query_rounds == 1:  # one after the other, each stopped before the next starts
            arrangements = {}
            for arrangement in each:
                arrangements.update(_taking_turns([arrangement], warmup, query_rounds, pause_s=0))
        else:
            arrangements = _taking_turns(each, warmup, query_rounds)
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
            "query_rounds": args.query_rounds,
            "omp_bind": args.omp_bind,
            "node_realtime_priority": args.node_realtime_priority,
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
        # Round by round: with --query-rounds K the two ran minutes apart at most.
        result["query_ttft_vs_floor_by_round"] = [
            round(m / f, 3)
            for m, f in zip(
                mesh["query_rounds_ttft_mean_ms"], floor["query_rounds_ttft_mean_ms"], strict=True
            )
        ]
    if mesh and alone:
        result["warmup_round_vs_vllm_alone"] = round(
            mesh["warmup_round_s"] / alone["warmup_round_s"], 3
        )
    if mesh and floor:
        # The floor's warm-up round computes every document cold as vLLM alone's does
        # (its larger cache pays only later): the same work in another process.
        result["warmup_round_vs_floor"] = round(mesh["warmup_round_s"] / floor["warmup_round_s"], 3)
    return result


def _taking_turns(
    each: list[Arrangement],
    warmup: list[list[int]],
    query_rounds: list[list[list[int]]],
    pause_s: float = TURN_PAUSE_S,
) -> dict[str, dict[str, Any]]:
    """Start and warm every arrangement, then let their query rounds take turns.

    The order of the turns alternates (forwards, then backwards), so that no
    arrangement always runs right after a warm-up or right before the end, and
    each round waits :data:`TURN_PAUSE_S` for the servers that answered last to
    go quiet.
    """
    abandoned = True
    try:
        for arrangement in each:
            arrangement.start()
            arrangement.run_round("warmup", warmup)
        for number, queries in enumerate(query_rounds):
            for arrangement in each if number % 2 == 0 else reversed(each):
                time.sleep(pause_s)
                arrangement.run_round("query", queries)
        results = {a.name: a.result() for a in each}
        abandoned = False
        return results
    finally:
        for arrangement in each:
            arrangement.stop(abandoned=abandoned)


def format_table(result: dict[str, Any]) -> str:
    """The figures as a table (only what this run measured)."""
    w = result["workload"]
    lines = [
        f"kvmesh bench serve: {result['model']}; {w['documents']} documents of "
        f"{w['doc_tokens']} tokens, asked {1 + w['query_rounds']} times, {w['concurrency']} in "
        f"flight, vLLM's cache "
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
    ratios = (
        "query_ttft_vs_floor",
        "query_ttft_vs_floor_by_round",
        "warmup_round_vs_vllm_alone",
        "warmup_round_vs_floor",
    )
    for key in ratios:
        if key in result:
            lines.append(f"{key}: {result[key]}")
    return "\n".join(lines)
