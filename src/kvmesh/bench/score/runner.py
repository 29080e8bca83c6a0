"""Options, the timed loop and the report of ``kvmesh bench score``."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvmesh.api.coordinator.v1 import directory_pb2, engines_pb2, ingest_pb2
from kvmesh.bench.common import Progress, cpu_seconds, percentile
from kvmesh.bench.ingest.server import coordinator_process
from kvmesh.common.convert import batch_to_proto
from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, Tier
from kvmesh.common.hashing import TokenHasher
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.coordinator.client import DirectoryClient, EventIngestClient
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.core.engines import EngineSpec
from kvmesh.coordinator.core.settings import CoordinatorSettings
from kvmesh.coordinator.engine_client import EngineClient

from .feed import EngineFeeds, FeedProcess

MODEL = "bench/score-model"
TARGET_P99_MS = 1.0
#: How long the timed calls go on past ``--calls`` waiting for the first batch applied.
_EVENTS_WAIT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=16, help="engines the coordinator follows")
    parser.add_argument(
        "--prompt-tokens", type=int, default=8000, help="tokens of the probed prompt"
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts each engine stores first")
    parser.add_argument(
        "--shared-tokens", type=int, default=2048, help="system prefix every prompt shares"
    )
    parser.add_argument("--block-size", type=int, default=16, help="the engines' block size")
    parser.add_argument("--chunk-size", type=int, default=256, help="kvmesh's chunk size")
    parser.add_argument(
        "--rate", type=float, default=50.0, help="batches/s each engine publishes while timed"
    )
    parser.add_argument("--calls", type=int, default=3000, help="timed ScoreEngines calls")
    parser.add_argument("--seed", type=int, default=7, help="seed of the token ids")


def _percentiles(samples: list[float]) -> dict[str, float]:
    ms = sorted(1e3 * s for s in samples)
    return {
        "p50_ms": round(percentile(ms, 0.5), 4),
        "p99_ms": round(percentile(ms, 0.99), 4),
        "max_ms": round(ms[-1], 4),
    }


def _applied(engines: EngineClient) -> int:
    listing = engines.list_engines(engines_pb2.ListEnginesRequest())
    return sum(s.batches for e in listing.engines for s in e.streams)


def _wait(predicate: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.engines < 1 or args.calls < 1 or args.prompt_tokens < args.chunk_size:
        raise SystemExit("--engines and --calls must be >= 1, --prompt-tokens >= --chunk-size")
    rng = random.Random(args.seed)
    shared = [rng.randrange(1, 30_000) for _ in range(args.shared_tokens)]

    def prompt() -> list[int]:
        return shared + [rng.randrange(1, 30_000) for _ in range(args.prompt_tokens - len(shared))]

    prompts = [[prompt() for _ in range(args.prompts)] for _ in range(args.engines)]
    probe_engine = args.engines // 2
    probe = prompts[probe_engine][0]
    hashes = TokenHasher(args.chunk_size).hash_chunks(probe)
    progress = Progress.for_args("score", args)
    feeds = FeedProcess(args.engines, args.block_size, args.seed)
    with progress, tempfile.TemporaryDirectory(prefix="kvmesh-bench-score-") as tmp:
        work = Path(tmp)
        (work / "engines.json").write_text(json.dumps(feeds.spec(MODEL)))
        extra = [
            "--engine-events-file", str(work / "engines.json"),
            "--chunk-size", str(args.chunk_size),
        ]  # fmt: skip
        progress.phase("starting the coordinator")
        try:
            with coordinator_process(work, extra) as coord:
                directory = DirectoryClient(coord.target)
                engines = EngineClient(coord.target, channel=directory.channel)
                ingest = EventIngestClient(coord.target, channel=directory.channel)
                progress.phase(f"{args.engines} engines store {args.prompts} prompts each")

                # A SUB socket misses what is sent before it has connected: publish
                # until every stream has applied a batch, then the prompts.
                def connected() -> bool:
                    for i in range(args.engines):
                        feeds.store_prompt(i, shared)
                    return _all_streams_applied(engines)

                _wait(connected, "every engine's first batch")
                for i, engine_prompts in enumerate(prompts):
                    for tokens in engine_prompts:
                        feeds.store_prompt(i, tokens)
                sent = feeds.sent()
                _wait(lambda: _applied(engines) >= sent, "the coordinator to apply the prompts")
                expected = len(hashes) * args.chunk_size
                request = directory_pb2.ScoreEnginesRequest(model_name=MODEL, token_ids=probe)
                _wait(
                    lambda: _top(directory, request) == (f"engine-{probe_engine:02d}", expected),
                    "the probed prompt's blocks",
                )
                _report_l1(ingest, hashes[: len(hashes) // 2])
                feeds.start_feeding(args.rate)
                result = _timed(args, progress, directory, engines, request, hashes, feeds)
                feeds.close()
                top = _top(directory, request)
                result["top_engine"] = top[0]
                result["top_engine_matched_tokens"] = top[1]
                result["answers_correct"] = top == (f"engine-{probe_engine:02d}", expected)
                result["coordinator_cpu_s"] = round(cpu_seconds(coord.proc.pid), 2)
                directory.close()
        finally:
            feeds.close()
    progress.phase("the same scoring in this process (no RPC), events applied between calls")
    result["in_process"] = _in_process(args, prompts, probe, hashes)
    result.update(
        engines=args.engines,
        prompt_tokens=args.prompt_tokens,
        chunks=len(hashes),
        block_size=args.block_size,
        chunk_size=args.chunk_size,
        target_p99_ms=TARGET_P99_MS,
    )
    return result


def _all_streams_applied(engines: EngineClient) -> bool:
    listing = engines.list_engines(engines_pb2.ListEnginesRequest())
    return all(s.batches > 0 for e in listing.engines for s in e.streams)


def _top(directory: DirectoryClient, request: directory_pb2.ScoreEnginesRequest) -> tuple[str, int]:
    best = directory.score_engines(request).scores[0]
    return best.engine_id, best.prefix_tokens


def _l1_batch(hashes: list[bytes]) -> CacheEventBatch:
    """One node's L1 store of ``hashes`` (so scores read the directory too)."""
    return CacheEventBatch(
        instance_id="node-a",
        incarnation=1,
        seq=1,
        event_type=EventType.STORE,
        tier=Tier.L1,
        backend="dram",
        entries=[
            CacheEventEntry(ObjectKey(h, MODEL, worker_kv_rank(1, 0)), 1 << 20) for h in hashes
        ],
    )


def _report_l1(ingest: EventIngestClient, hashes: list[bytes]) -> None:
    batch = batch_to_proto(_l1_batch(hashes))
    ingest.ingest_batches(ingest_pb2.IngestBatchesRequest(batches=[batch]))


def _timed(
    args: argparse.Namespace,
    progress: Progress,
    directory: DirectoryClient,
    engines: EngineClient,
    request: directory_pb2.ScoreEnginesRequest,
    hashes: list[bytes],
    feeds: FeedProcess,
) -> dict[str, Any]:
    by_hashes = directory_pb2.ScoreEnginesRequest(model_name=MODEL, chunk_hashes=hashes)
    stats = directory_pb2.GetStatsRequest()
    for _ in range(min(200, args.calls)):  # warm-up: channel, caches, allocator
        directory.score_engines(request)
    progress.phase("timed ScoreEngines calls while the engines publish", args.calls)
    applied0, sent0, t0 = _applied(engines), feeds.sent(), time.monotonic()
    tokens_form: list[float] = []
    hashes_form: list[float] = []
    floor: list[float] = []

    def one_call() -> None:
        start = time.perf_counter()
        directory.score_engines(request)
        tokens_form.append(time.perf_counter() - start)
        start = time.perf_counter()
        directory.score_engines(by_hashes)
        hashes_form.append(time.perf_counter() - start)
        start = time.perf_counter()
        directory.get_stats(stats)
        floor.append(time.perf_counter() - start)

    for i in range(args.calls):
        one_call()
        if i % 100 == 0:
            progress.count(i)
    # A short run on a busy host can end before the coordinator applied any batch;
    # it goes on until one was, so every figure is of calls while events flow.
    while _applied(engines) == applied0 and time.monotonic() - t0 < _EVENTS_WAIT_S:
        for _ in range(10):
            one_call()
    elapsed = time.monotonic() - t0
    applied, sent = _applied(engines) - applied0, feeds.sent() - sent0
    if applied == 0:
        raise RuntimeError(
            f"the coordinator applied none of the engines' batches in {elapsed:.1f} s of timed "
            "calls: the feed is not flowing"
        )
    tokens_p = _percentiles(tokens_form)
    return {
        "calls": len(tokens_form),
        "score_p50_ms": tokens_p["p50_ms"],
        "score_p99_ms": tokens_p["p99_ms"],
        "score_max_ms": tokens_p["max_ms"],
        "score_by_hashes": _percentiles(hashes_form),
        "empty_rpc": _percentiles(floor),
        "offered_batches_per_s": round(sent / elapsed, 1),
        "applied_batches_per_s": round(applied / elapsed, 1),
    }


def _in_process(
    args: argparse.Namespace, prompts: list[list[list[int]]], probe: list[int], hashes: list[bytes]
) -> dict[str, float]:
    """``Coordinator.score_engines`` timed in this process, the feed applied between calls.

    As in the coordinator, where events and RPCs take turns on one event loop:
    before each call, the engine steps due by then at ``--rate`` are applied
    (untimed), so the figure is the call's own work on an index that keeps
    changing.
    """
    core = Coordinator(
        CoordinatorSettings(
            chunk_size=args.chunk_size,
            health_check_interval=0,
            eviction_check_interval=0,
            checkpoint_interval=0,
        )
    )
    feeds = EngineFeeds(
        args.engines,
        args.block_size,
        args.seed,
        sink=lambda engine_id, events: core.engines.index.apply(engine_id, 0, events),
    )
    for engine in feeds.engines:
        core.engines.register(EngineSpec(engine.engine_id, "inproc://bench", MODEL))
    for i, engine_prompts in enumerate(prompts):
        for tokens in engine_prompts:
            feeds.store_prompt(i, tokens)
    core.ingest(_l1_batch(hashes[: len(hashes) // 2]))
    request = directory_pb2.ScoreEnginesRequest(model_name=MODEL, token_ids=probe)
    samples = []
    steps, began = 0, time.monotonic()
    for _ in range(args.calls):
        while steps < (time.monotonic() - began) * args.rate:
            feeds.step()
            steps += 1
        start = time.perf_counter()
        core.score_engines(model_name=MODEL, token_ids=request.token_ids)
        samples.append(time.perf_counter() - start)
    feeds.close()
    return {**_percentiles(samples), "steps_per_s": round(steps / (time.monotonic() - began), 1)}


def format_table(result: dict[str, Any]) -> str:
    r = result
    lines = [
        f"ScoreEngines: {r['prompt_tokens']}-token prompt ({r['chunks']} chunks), "
        f"{r['engines']} engines, {r['calls']} calls",
        f"  token ids       p50 {r['score_p50_ms']:.3f} ms  p99 {r['score_p99_ms']:.3f} ms  "
        f"max {r['score_max_ms']:.3f} ms  (target p99 < {r['target_p99_ms']} ms)",
        f"  chunk hashes    p50 {r['score_by_hashes']['p50_ms']:.3f} ms  "
        f"p99 {r['score_by_hashes']['p99_ms']:.3f} ms",
        f"  in process      p50 {r['in_process']['p50_ms']:.3f} ms  "
        f"p99 {r['in_process']['p99_ms']:.3f} ms  (the scoring alone, no RPC)",
        f"  empty RPC       p50 {r['empty_rpc']['p50_ms']:.3f} ms  "
        f"p99 {r['empty_rpc']['p99_ms']:.3f} ms  (GetStats: the floor of one call)",
        f"  ingest while timed: offered {r['offered_batches_per_s']} batches/s, "
        f"applied {r['applied_batches_per_s']} batches/s",
        f"  best engine {r['top_engine']} matched {r['top_engine_matched_tokens']} tokens "
        f"({'correct' if r['answers_correct'] else 'WRONG'}); "
        f"coordinator CPU {r['coordinator_cpu_s']} s",
    ]
    return "\n".join(lines)
