"""One arrangement of ``kvmesh bench serve``: its vLLM server (and node), rounds and figures.

An :class:`Arrangement` starts its processes, answers one prompt of its own
outside the rounds (a process's first request is slower), runs the rounds it
is given, and turns what it measured into the arrangement's figures. The
caller decides the order: one arrangement after another, or every
arrangement up at once with the query rounds taking turns (docs/benchmarks.md,
"Reading `bench serve` on a noisy host").
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.bench import node_figures
from kvmesh.bench.common import Progress, connector_options, node_realtime_args
from kvmesh.bench.serve.client import Answer, run_round, stream_completion, ttft_summary
from kvmesh.bench.serve.servers import (
    ABANDON_GRACE_S,
    STOP_GRACE_S,
    Node,
    Server,
    metrics,
    start_node,
    start_vllm,
)

CHUNK = 256
QUESTION_TOKENS = 24

#: vLLM's per-request histograms that split a TTFT: waiting to be scheduled (the
#: connector's lookup included), then scheduled until the first token (the load
#: from kvmesh and the forward pass).
PHASES = {
    "queue_ms_mean": "vllm:request_queue_time_seconds",
    "prefill_ms_mean": "vllm:request_prefill_time_seconds",
}


@dataclass
class Round:
    """One round's answers and figures."""

    answers: list[Answer]
    seconds: float
    summary: dict[str, float]


def _phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per request of each of :data:`PHASES` over a round."""
    out = {}
    for key, series in PHASES.items():
        count = after.get(f"{series}_count", 0.0) - before.get(f"{series}_count", 0.0)
        total = after.get(f"{series}_sum", 0.0) - before.get(f"{series}_sum", 0.0)
        out[key] = round(1e3 * total / count, 1) if count else 0.0
    return out


def pooled(rounds: list[Round]) -> dict[str, float]:
    """The figures of several rounds of the same kind taken together.

    TTFTs are pooled over every answer; a round's time and vLLM's phase means
    are the mean over the rounds (each round asks as many requests).
    """
    if len(rounds) == 1:
        return dict(rounds[0].summary)
    answers = [a for r in rounds for a in r.answers]
    out = ttft_summary(answers, statistics.fmean(r.seconds for r in rounds))
    for key in PHASES:
        out[key] = round(statistics.fmean(r.summary[key] for r in rounds), 1)
    return out


class Arrangement:
    """One arrangement's processes and what they measured (see the module docstring)."""

    def __init__(
        self,
        args: argparse.Namespace,
        name: str,
        model: Path,
        shape: dict[str, int],
        work: Path,
        progress: Progress,
    ) -> None:
        self.args = args
        self.name = name
        self.model = model
        self.shape = shape
        self.work = work
        self.progress = progress
        self.node: Node | None = None
        self.server: Server | None = None
        self.rounds: dict[str, list[Round]] = {}
        prompt_tokens = args.doc_tokens + QUESTION_TOKENS + args.output_tokens
        self.prompt_tokens = prompt_tokens
        blocks_per_prompt = math.ceil(prompt_tokens / args.block_size)
        if name == "floor":
            self.blocks = (args.documents + args.concurrency + 1) * blocks_per_prompt
        else:
            self.blocks = max(
                math.ceil(args.cache_docs * args.doc_tokens / args.block_size),
                args.concurrency * blocks_per_prompt,
            )
        self._before: dict[str, float] = {}
        self._node_before: dict[node_figures.SampleKey, float] = {}
        self._cpu_before = 0.0
        self._preempted_before = 0

    def start(self) -> None:
        """Start the node (kvmesh) and vLLM, answer the first prompt, read the counters."""
        args = self.args
        block_bytes = self.shape["kv_bytes_per_token"] * args.block_size
        gib = max(1, math.ceil(self.blocks * block_bytes * 1.1 / 2**30))
        if self.name == "kvmesh":
            self.progress.phase("kvmesh: starting a kvmesh node")
            self.node = start_node(
                self.work, args.l1_size, CHUNK, node_realtime_args(args.node_realtime_priority)
            )
        self.progress.phase(
            f"{self.name}: starting vLLM ({self.blocks} KV blocks of {args.block_size} tokens)"
        )
        self.server = start_vllm(
            self.work,
            self.name,
            self.model,
            kv_blocks=self.blocks,
            kv_cache_gib=gib,
            block_size=args.block_size,
            max_model_len=min(self.shape["context"], 2 * self.prompt_tokens),
            gateway=self.node.lane if self.node else None,
            omp_bind=args.omp_bind,
            connector=connector_options(args.connector_option),
        )
        # The process's first request, outside the rounds and their counters, shares
        # nothing with them (a process's first request is slower).
        rng = random.Random(args.seed + 7919)
        first = [rng.randrange(3, 30000) for _ in range(args.doc_tokens)]
        stream_completion("127.0.0.1", self.server.port, "bench", first, 1, 600)
        node = self.node
        if node is not None:
            time.sleep(1.0)  # its stores land before the counters are read
            self._before = node.counters()
            self._node_before = node_figures.scrape([node.metrics_url])
            self._cpu_before = node.cpu_seconds()
        self._preempted_before = self._preemptions()

    def run_round(self, label: str, prompts: list[list[int]]) -> Round:
        """Ask ``prompts``, ``--concurrency`` in flight; the round is kept under ``label``."""
        server = self.server
        assert server is not None, "start() first"
        number = len(self.rounds.get(label, [])) + 1
        title = label if number == 1 else f"{label} {number}"
        self.progress.phase(f"{self.name}: {title} round", len(prompts), "answered")
        answered = 0

        def send(i: int) -> tuple[float, float, int]:
            return stream_completion(
                "127.0.0.1", server.port, "bench", prompts[i], self.args.output_tokens, 600
            )

        def show(a: Answer) -> None:
            nonlocal answered
            answered += 1
            self.progress.count(answered)
            self.progress.say(f"{self.name}: {title} {a.index + 1}: TTFT {1e3 * a.ttft_s:.0f} ms")

        before = metrics(server.metrics_url)
        answers, elapsed = run_round(send, len(prompts), self.args.concurrency, show)
        summary = {**ttft_summary(answers, elapsed), **_phases(before, metrics(server.metrics_url))}
        done = Round(answers, elapsed, summary)
        self.rounds.setdefault(label, []).append(done)
        return done

    def result(self) -> dict[str, Any]:
        """The arrangement's figures over every round it ran (after the last round)."""
        warmup = pooled(self.rounds["warmup"])
        query = pooled(self.rounds["query"])
        out: dict[str, Any] = {
            "kv_blocks": self.blocks,
            "warmup_ttft_mean_ms": warmup["ttft_mean_ms"],
            "warmup_ttft_p50_ms": warmup["ttft_p50_ms"],
            "warmup_ttft_p90_ms": warmup["ttft_p90_ms"],
            "warmup_ttft_max_ms": warmup["ttft_max_ms"],
            "warmup_round_s": warmup["round_s"],
            "query_ttft_mean_ms": query["ttft_mean_ms"],
            "query_ttft_p50_ms": query["ttft_p50_ms"],
            "query_ttft_p90_ms": query["ttft_p90_ms"],
            "query_ttft_max_ms": query["ttft_max_ms"],
            "query_round_s": query["round_s"],
            # Each query round's own mean TTFT, in the order they ran.
            "query_rounds_ttft_mean_ms": [r.summary["ttft_mean_ms"] for r in self.rounds["query"]],
            # TTFT split by vLLM's own request timings (queue, then prefill).
            "warmup_queue_ms_mean": warmup["queue_ms_mean"],
            "warmup_prefill_ms_mean": warmup["prefill_ms_mean"],
            "query_queue_ms_mean": query["queue_ms_mean"],
            "query_prefill_ms_mean": query["prefill_ms_mean"],
            "cached_tokens": warmup["cached_tokens"] + query["cached_tokens"],
            "preemptions": self._preemptions() - self._preempted_before,
        }
        if self.node is not None:
            out.update(self._node_result())
        return out

    def _node_result(self) -> dict[str, Any]:
        node = self.node
        assert node is not None
        # Stores finish in the background after the answers: let them land.
        time.sleep(2.0)
        after = node.counters()

        def delta(series: str) -> float:
            return after.get(series, 0.0) - self._before.get(series, 0.0)

        chunk_bytes = self.shape["kv_bytes_per_token"] * CHUNK
        return {
            "tokens_from_kvmesh": int(delta("kvmesh_gateway_retrieved_chunks_total")) * CHUNK,
            "stored_chunks": int(delta("kvmesh_gateway_stored_chunks_total")),
            "stored_bytes": int(delta("kvmesh_gateway_stored_chunks_total")) * chunk_bytes,
            "store_skipped_chunks": int(delta("kvmesh_gateway_store_skipped_chunks_total")),
            "kvmesh_cpu_s": round(node.cpu_seconds() - self._cpu_before, 2),
            # L1 grows while the rounds run: how many store calls waited for a
            # new segment, the longest wait since the node started, and segments.
            "l1_growth_waits": int(delta("kvmesh_storage_l1_growth_waits_total")),
            "l1_growth_wait_max_ms": round(
                1e3 * after.get("kvmesh_storage_l1_growth_wait_max_seconds", 0.0), 1
            ),
            "l1_segments": int(after.get("kvmesh_storage_l1_segments", 0)),
            # The node's handlers and copies over every round (retrieves are the
            # query rounds' loads, stores the warm-up's): bench/node_figures.py.
            "node": node_figures.figures(
                self._node_before, node_figures.scrape([node.metrics_url])
            ),
        }

    def stop(self, *, abandoned: bool) -> None:
        """Stop vLLM and the node (briefly when the run is being abandoned)."""
        grace = ABANDON_GRACE_S if abandoned else STOP_GRACE_S
        if self.server is not None:
            self.server.process.stop(grace)
        if self.node is not None:
            self.node.process.stop(grace)

    def _preemptions(self) -> int:
        assert self.server is not None
        return int(metrics(self.server.metrics_url).get("vllm:num_preemptions_total", 0.0))
