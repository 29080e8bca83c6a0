"""``run`` of ``kvmesh bench route``: the fleet, a warm-up, then each router's requests."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.bench.common import Progress
from kvmesh.bench.serve.client import Answer, run_round, stream_completion, ttft_summary
from kvmesh.bench.serve.servers import model_shape
from kvmesh.common.model_store import resolve as resolve_model
from kvmesh.engine.vllm.model import make_tiny_model

from .fleet import Fleet, Sizes, start_fleet
from .params import BLOCK_SIZE, CHUNK, chosen_routers, omp_binds
from .routers import OracleRouter, RoundRobinRouter, Router, ScoreRouter
from .workload import Request, Shape, requests, warmup_prompt

#: The name vLLM serves the model under (see kvmesh.bench.serve.servers.launch_vllm).
SERVED_MODEL = "bench"
#: Seconds one request may take.
REQUEST_TIMEOUT_S = 600.0
#: Seconds the coordinator may take to show an engine's first prompt.
EVENTS_TIMEOUT_S = 60.0


def _sizes(args: argparse.Namespace, shape: Shape, model: Path, routers: int) -> Sizes:
    """vLLM's KV cache holds every router's prompts (nothing evicted: the oracle's model)."""
    kv = model_shape(model)
    longest = shape.prompt_tokens + args.output_tokens
    if longest > kv["context"]:
        raise SystemExit(
            f"kvmesh bench route: a prompt and its answer ({longest} tokens) exceed the "
            f"model's context ({kv['context']})"
        )
    per_prompt = math.ceil(longest / BLOCK_SIZE)
    # A group's prefix once, and per request the blocks past the prefix's whole blocks; one
    # engine may be sent everything (a router may pick it every time), plus its warm-up
    # prompt and the requests in flight.
    tail = math.ceil((shape.prefix_tokens % BLOCK_SIZE + shape.suffix_tokens) / BLOCK_SIZE) + 1
    per_router = shape.groups * (
        shape.prefix_tokens // BLOCK_SIZE + shape.requests_per_group * tail
    )
    blocks = math.ceil(1.1 * routers * per_router) + (1 + args.concurrency) * per_prompt
    block_bytes = kv["kv_bytes_per_token"] * BLOCK_SIZE
    return Sizes(
        kv_blocks=blocks,
        kv_cache_gib=max(1, math.ceil(blocks * block_bytes * 1.1 / 2**30)),
        max_model_len=min(kv["context"], per_prompt * BLOCK_SIZE),
        l1_size=args.l1_size,
        p2p=args.p2p,
        omp_binds=omp_binds(args),
    )


def _warm_up(fleet: Fleet, shape: Shape, model: Path, progress: Progress, check: bool) -> None:
    """Each engine's first request (slower than the rest), outside every router's figures.

    With ``check``, wait until the coordinator scores each warm-up prompt as
    cached in its engine: its KV events arrive and meet the model name.
    """
    for i, engine in enumerate(fleet.engines):
        progress.phase(f"warm-up: {engine.engine_id}'s first request")
        stream_completion(
            "127.0.0.1",
            engine.server.port,
            SERVED_MODEL,
            warmup_prompt(shape, i),
            1,
            REQUEST_TIMEOUT_S,
        )
    if not check:
        return
    progress.phase("warm-up: waiting for the coordinator to score each engine's prompt")
    router = ScoreRouter([e.engine_id for e in fleet.engines], fleet.coordinator, str(model))
    try:
        for i, engine in enumerate(fleet.engines):
            deadline = time.monotonic() + EVENTS_TIMEOUT_S
            while True:
                scores = router.scores(warmup_prompt(shape, i)).scores
                if any(s.engine_id == engine.engine_id and s.engine_tokens for s in scores):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the coordinator does not score {engine.engine_id}'s prompt after "
                        f"{EVENTS_TIMEOUT_S:.0f} s (its KV events do not arrive, or their model "
                        f"name is not {model}): {scores}"
                    )
                time.sleep(0.2)
    finally:
        router.close()


def _make_router(name: str, fleet: Fleet, model: Path) -> Router:
    engines = [e.engine_id for e in fleet.engines]
    if name == "score":
        return ScoreRouter(engines, fleet.coordinator, str(model))
    if name == "oracle":
        return OracleRouter(len(engines), CHUNK)
    return RoundRobinRouter(len(engines))


def _run_router(
    name: str,
    fleet: Fleet,
    model: Path,
    batch: Sequence[Request],
    args: argparse.Namespace,
    progress: Progress,
) -> dict[str, Any]:
    """Send one router's requests; its figures."""
    progress.phase(f"{name}: routing {len(batch)} requests", len(batch), "answered")
    engine_of = [0] * len(batch)
    router = _make_router(name, fleet, model)
    answered = 0

    def send(index: int) -> tuple[float, float, int]:
        prompt = batch[index].prompt
        engine = router.pick(prompt)
        engine_of[index] = engine
        try:
            return stream_completion(
                "127.0.0.1",
                fleet.engines[engine].server.port,
                SERVED_MODEL,
                prompt,
                args.output_tokens,
                REQUEST_TIMEOUT_S,
            )
        finally:
            router.done(engine)

    def show(answer: Answer) -> None:
        nonlocal answered
        answered += 1
        progress.count(answered)
        progress.say(
            f"{name}: request {answer.index + 1} (group {batch[answer.index].group}) on "
            f"{fleet.engines[engine_of[answer.index]].engine_id}: TTFT "
            f"{1e3 * answer.ttft_s:.0f} ms, {answer.cached_tokens} tokens cached"
        )

    try:
        answers, elapsed = run_round(send, len(batch), args.concurrency, show)
        figures = router.figures()
    finally:
        router.close()
    return _summary(fleet, batch, answers, engine_of, elapsed) | figures


def _summary(
    fleet: Fleet,
    batch: Sequence[Request],
    answers: Sequence[Answer],
    engine_of: Sequence[int],
    elapsed: float,
) -> dict[str, Any]:
    figures: dict[str, Any] = ttft_summary(answers, elapsed)
    hit_tokens = figures.pop("cached_tokens")
    prompt_tokens = sum(len(r.prompt) for r in batch)
    return {
        "requests": len(batch),
        "answered": len(answers),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "hit_rate": round(hit_tokens / prompt_tokens, 4),
        **figures,
        "requests_per_engine": {
            e.engine_id: sum(1 for i in engine_of if i == n) for n, e in enumerate(fleet.engines)
        },
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the fleet, run the chosen routers one after the other; one JSON-ready dict."""
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("kvmesh bench route: vLLM is not installed (pip install 'kvmesh[vllm]')")
    names = chosen_routers(args)
    with (
        tempfile.TemporaryDirectory(prefix="kvmesh-bench-route-") as tmp,
        Progress.for_args("route", args) as progress,
    ):
        work = Path(tmp)
        progress.phase("making the model's folder")
        # Absolute: vLLM's model name (the connector's and the coordinator's) is this text.
        model = resolve_model(args.model) if args.model else make_tiny_model(work / "model")
        model = model.resolve()
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        shape = Shape(
            groups=args.groups,
            prefix_tokens=args.prefix_tokens,
            requests_per_group=args.requests_per_group,
            suffix_tokens=args.suffix_tokens,
            vocab_size=vocab,
            seed=args.seed,
        )
        sizes = _sizes(args, shape, model, len(names))
        with start_fleet(work, model, sizes, progress) as fleet:
            _warm_up(fleet, shape, model, progress, check="score" in names)
            routers = {
                name: _run_router(name, fleet, model, requests(shape, name), args, progress)
                for name in names
            }
            engine_ids = [e.engine_id for e in fleet.engines]
    return _result(args, shape, sizes, engine_ids, routers)


def _result(
    args: argparse.Namespace,
    shape: Shape,
    sizes: Sizes,
    engine_ids: list[str],
    routers: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "route",
        "model": args.model or "tiny random-weight Llama (kvmesh.engine.vllm.model)",
        "engines": engine_ids,
        "workload": {
            "groups": shape.groups,
            "prefix_tokens": shape.prefix_tokens,
            "requests_per_group": shape.requests_per_group,
            "suffix_tokens": shape.suffix_tokens,
            "output_tokens": args.output_tokens,
            "concurrency": args.concurrency,
            "requests": shape.requests,
            "reusable_tokens": shape.reusable_tokens(CHUNK),
            "chunk_size": CHUNK,
            "kv_blocks": sizes.kv_blocks,
            "p2p": sizes.p2p,
            "omp_binds": sizes.omp_binds,
            "seed": shape.seed,
        },
        "routers": routers,
    }
    score, round_robin, oracle = (routers.get(n) for n in ("score", "round_robin", "oracle"))
    if score:
        result["score_p50_ms"] = score["score_p50_ms"]
        result["score_p99_ms"] = score["score_p99_ms"]
    if score and oracle:
        result["score_vs_oracle_hit_ratio"] = _ratio(score["hit_tokens"], oracle["hit_tokens"])
    if round_robin and oracle:
        result["round_robin_vs_oracle_hit_ratio"] = _ratio(
            round_robin["hit_tokens"], oracle["hit_tokens"]
        )
    if score and round_robin:
        result["score_vs_round_robin_ttft_ratio"] = _ratio(
            score["ttft_mean_ms"], round_robin["ttft_mean_ms"]
        )
    return result
