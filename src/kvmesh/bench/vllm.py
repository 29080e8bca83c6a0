"""``kvmesh bench vllm``: real vLLM's time to first token, cold, from kvmesh, and its own floor.

Needs ``pip install 'kvmesh[vllm]'`` (the CPU build of vLLM on these
machines). Every figure comes from fresh vLLM processes of one run, each bound
to every core (:func:`kvmesh.engine.vllm.worker.engine_env`), over the same
``--prompts`` random prompts of ``--prompt-tokens`` tokens and one output
token, so ``generate``'s wall time is the time to first token. Each process
first runs a warm-up prompt of its own, as long as the others, so no figure pays
vLLM's first call or the first prefill of its full-size steps (that first prompt
was 10-20 % slower than the rest here when the warm-up was short).

1. ``cold``: no connector, vLLM's prefix caching off (the cost of a prefill);
2. ``prefix_cache``: no connector, vLLM's prefix caching on, each prompt twice in
   one process: the second run is vLLM's own prefix-cache hit (the floor);
3. ``miss``: kvmesh's connector against an empty cache: every lookup misses and
   the prompt's chunks are stored (what kvmesh costs when it cannot help). The
   same process also runs each prompt with kvmesh switched off for that
   request (docs/vllm.md, "Per-request switches"): a cold prefill of that
   process, before or after the miss, alternating;
4. ``warm``: a fresh process with the connector and vLLM's prefix caching on:
   each prompt comes from kvmesh, then, run again, from vLLM's own cache (the
   floor of that process).

Processes of one VM run the same prompts at speeds up to a fifth apart
(docs/performance.md, "One process's cold and miss, and its warm and floor"),
so besides the ratios across arrangements the figures include the same two
ratios within one process: each prompt's miss over its own cold run, and its
warm run over its own prefix-cache hit (medians of those per-prompt ratios).

The fleet is a local one of the benchmark's own (one node, ``kvmesh node`` by
default or ``--arrangement processes``, the engines on the gateway's lane)
unless ``--gateway`` is given. Each
run keys its chunks under a model name of its own, so "miss" is a miss even
against a gateway that served an earlier run. Figures are medians over the
prompts. ``outputs_match`` compares the greedy token of every warm run with the
cold run's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

from kvmesh.bench import node_figures
from kvmesh.bench.common import (
    Progress,
    add_connector_option_argument,
    add_model_argument,
    add_node_realtime_argument,
    connector_options,
    node_realtime_args,
)
from kvmesh.common.model_store import resolve as resolve_model
from kvmesh.engine.vllm.model import make_tiny_model
from kvmesh.engine.vllm.runner import run_engine

MIN_PROMPT_TOKENS = 600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmesh bench vllm``."""
    add_model_argument(parser)
    parser.add_argument("--prompt-tokens", type=int, default=8000, help="tokens per prompt")
    parser.add_argument(
        "--prompts", type=int, default=5, help="distinct prompts; figures are their medians"
    )
    parser.add_argument(
        "--gateway",
        metavar="ADDR",
        default=None,
        help="kvmesh gateway the engines use (default: a local fleet of the benchmark's own)",
    )
    parser.add_argument(
        "--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of each engine"
    )
    parser.add_argument(
        "--arrangement",
        choices=("node", "processes"),
        default="node",
        help="the benchmark's own fleet: node = storage and gateway in one process (kvmesh "
        "node, the usual deployment on a host); processes = apart, as kvmesh up runs them "
        "(default: node)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument(
        "--gap-s",
        type=float,
        default=1.0,
        help="idle seconds after each prompt, in every arrangement, so one prompt's background "
        "stores do not land in the next prompt's prefill (0: back to back)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the four arrangements this many times, one after another; the figures "
        "pool every round's prompts and each round's own ratios are listed too (on a shared "
        "VM whose speed drifts within minutes, a ratio within one round is the fair one)",
    )
    cores = os.cpu_count() or 1
    parser.add_argument(
        "--omp-bind",
        default=f"0-{cores - 1}",
        help="VLLM_CPU_OMP_THREADS_BIND of every arrangement: every core by default, so the "
        "figures are vLLM's fastest; 0 leaves the other cores to kvmesh, as bench serve does "
        "on 2 cores",
    )
    parser.add_argument(
        "--engine-timeout-s",
        type=float,
        default=1800.0,
        help="seconds one vLLM process may run, start to exit, before it is killed and the "
        "benchmark fails (a real model's cold 8000-token prompts take minutes each on a "
        "slow 2-core host; default: 1800)",
    )
    add_connector_option_argument(parser)
    add_node_realtime_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _prompts(count: int, tokens: int, seed: int, vocab: int = 32000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(tokens)] for _ in range(count)]


def _median_ms(runs: list[dict[str, Any]]) -> float:
    return round(float(statistics.median(r["ttft_s"] for r in runs)) * 1e3, 2)


def _paired(runs: list[dict[str, Any]], baselines: list[dict[str, Any]]) -> float:
    """The median over prompts of each run's time over its own baseline's (same process)."""
    return float(
        statistics.median(r["ttft_s"] / b["ttft_s"] for r, b in zip(runs, baselines, strict=True))
    )


def _figures(one: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Medians and ratios of a set of runs (one round's, or every round's pooled)."""
    cold, floor = _median_ms(one["cold"]), _median_ms(one["floor"])
    miss, warm = _median_ms(one["miss"]), _median_ms(one["warm"])
    return {
        "ttft_cold_ms": cold,
        "ttft_prefix_cache_ms": floor,
        "ttft_miss_ms": miss,
        "ttft_warm_ms": warm,
        "warm_over_prefix_cache": round(warm / floor, 2),
        "miss_cost_fraction_of_cold": round((miss - cold) / cold, 3),
        # Within one process: kvmesh switched off for a request, and vLLM's own hit.
        "ttft_cold_same_process_ms": _median_ms(one["cold_same_process"]),
        "ttft_prefix_cache_same_process_ms": _median_ms(one["floor_same_process"]),
        "warm_over_prefix_cache_same_process": round(
            _paired(one["warm"], one["floor_same_process"]), 2
        ),
        "miss_cost_fraction_same_process": round(
            _paired(one["miss"], one["cold_same_process"]) - 1.0, 3
        ),
    }


#: A request's switches keeping kvmesh out of it (docs/vllm.md, "Per-request switches").
KVMESH_OFF = {"kvmesh": {"lookup": False, "store": False}}


def _miss_spec(warmup: list[int], prompts: list[list[int]]) -> tuple[dict[str, Any], list[bool]]:
    """The miss process's prompts: each as a miss and with kvmesh off, which first
    alternating; and, per run after the warm-up, whether it was the miss."""
    runs: list[tuple[list[int], dict[str, Any] | None]] = []
    for index, prompt in enumerate(prompts):
        pair = [(prompt, None), (prompt, KVMESH_OFF)]
        runs += pair if index % 2 == 0 else pair[::-1]
    spec = {
        "prompts": [warmup, *(p for p, _ in runs)],
        "kv_transfer_params": [None, *(t for _, t in runs)],
    }
    return spec, [t is None for _, t in runs]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the four arrangements; the figures as one dict."""
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("kvmesh bench vllm: vLLM is not installed (pip install 'kvmesh[vllm]')")
    if args.prompt_tokens < MIN_PROMPT_TOKENS or args.prompts < 1 or args.rounds < 1:
        raise SystemExit(
            f"kvmesh bench vllm: --prompt-tokens must be >= {MIN_PROMPT_TOKENS}, --prompts and "
            "--rounds >= 1"
        )
    if not args.engine_timeout_s > 0:
        raise SystemExit("kvmesh bench vllm: --engine-timeout-s must be positive")
    if args.gateway is not None and args.node_realtime_priority:
        raise SystemExit(
            "kvmesh bench vllm: --node-realtime-priority sets the benchmark's own node; "
            "with --gateway, start that node with --realtime-priority instead"
        )
    options = connector_options(args.connector_option)
    progress = Progress.for_args("vllm", args)
    with progress, tempfile.TemporaryDirectory(prefix="kvmesh-bench-vllm-") as tmp:
        progress.say(
            f"{args.rounds} round(s) of 4 arrangements, each a fresh vLLM process over "
            f"{args.prompts} prompts of {args.prompt_tokens} tokens after a warm-up prompt"
        )
        progress.phase(
            f"finding the model {args.model}" if args.model else "making a tiny random-weight Llama"
        )
        model = resolve_model(args.model) if args.model else make_tiny_model(Path(tmp) / "model")
        prompts = _prompts(args.prompts, args.prompt_tokens, args.seed)
        # A warm-up of each process's own: it must share no chunk with the prompts.
        warmup = _prompts(1, args.prompt_tokens, args.seed + 1_000_003)[0]
        base = {
            "model": str(model),
            "max_tokens": 1,
            # Every arrangement idles a moment after each prompt, so a prompt's background
            # stores are not timed as part of the next prompt's prefill (on 2 cores they
            # would compete with it); each figure is then one request's own time.
            "gap_s": args.gap_s,
            "kv_cache_gib": args.kv_cache_gib,
            "omp_bind": args.omp_bind,
        }
        fleet = None
        gateway = args.gateway
        if gateway is None:
            from kvmesh.cli.fleet import Fleet, FleetOptions

            progress.phase(f"starting a local fleet ({args.arrangement})")
            fleet = Fleet(
                FleetOptions(
                    data_dir=Path(tmp) / "fleet",
                    l1_size_bytes=2 << 30,
                    colocated=args.arrangement == "node",
                    extra_storage_args=node_realtime_args(args.node_realtime_priority),
                )
            )
            fleet.start()
            gateway = fleet.endpoint("node-0-gateway", "lane")
        # The node's own metrics over the miss and the warm phases (own fleet only).
        node_urls = (
            sorted(
                {
                    f"http://{fleet.endpoint(name, 'metrics')}/metrics"
                    for name in ("node-0-storage", "node-0-gateway")
                }
            )
            if fleet is not None
            else []
        )
        node_phases: dict[str, dict[node_figures.SampleKey, float]] = {"miss": {}, "warm": {}}
        rounds: list[dict[str, list[dict[str, Any]]]] = []
        limit = args.engine_timeout_s
        try:
            for index in range(args.rounds):
                # A model name of the round's own: nothing an earlier round stored can hit.
                name = f"bench-vllm-{uuid.uuid4().hex[:8]}"
                spec = {**base, "connector": {**options, "model_name": name}}
                step = f"round {index + 1}/{args.rounds}"
                runs = f"{len(prompts) + 1} prompts"
                progress.phase(f"{step}: cold: vLLM alone, prefix caching off ({runs})")
                cold = run_engine({**spec, "prompts": [warmup, *prompts]}, timeout_s=limit)[1:]
                twice = [p for p in prompts for _ in range(2)]
                progress.phase(
                    f"{step}: prefix cache: vLLM alone, each prompt twice "
                    f"({len(twice) + 1} prompts)"
                )
                floor_runs = run_engine(
                    {**spec, "prefix_caching": True, "prompts": [warmup, *twice]},
                    timeout_s=limit,
                )
                floor = floor_runs[2::2]
                progress.phase(
                    f"{step}: miss: kvmesh connector, empty cache, each prompt also with "
                    f"kvmesh off ({2 * len(prompts) + 1} prompts)"
                )
                before = node_figures.scrape(node_urls)
                miss_spec, is_miss = _miss_spec(warmup, prompts)
                both = run_engine({**spec, **miss_spec, "gateway": gateway}, timeout_s=limit)[1:]
                miss = [r for r, on in zip(both, is_miss, strict=True) if on]
                cold_here = [r for r, on in zip(both, is_miss, strict=True) if not on]
                between = node_figures.scrape(node_urls)
                progress.phase(
                    f"{step}: warm: a fresh vLLM process, prompts from kvmesh, each then from "
                    f"vLLM's own cache ({len(twice) + 1} prompts)"
                )
                warm_runs = run_engine(
                    {**spec, "gateway": gateway, "prefix_caching": True,
                     "prompts": [warmup, *twice]},
                    timeout_s=limit,
                )  # fmt: skip
                warm, floor_here = warm_runs[1::2], warm_runs[2::2]
                node_figures.accumulate(node_phases["miss"], before, between)
                node_figures.accumulate(
                    node_phases["warm"], between, node_figures.scrape(node_urls)
                )
                rounds.append(
                    {"cold": cold, "floor": floor, "miss": miss, "warm": warm,
                     "cold_same_process": cold_here, "floor_same_process": floor_here}
                )  # fmt: skip
        finally:
            if fleet is not None:
                progress.phase("stopping the fleet")
                fleet.stop()
    pooled = {name: [r for one in rounds for r in one[name]] for name in rounds[0]}
    cold, floor, warm = pooled["cold"], pooled["floor"], pooled["warm"]
    result: dict[str, Any] = {
        "prompt_tokens": args.prompt_tokens,
        "connector_options": options,
        **_figures(pooled),
        "tokens_from_cache": min(r["cached_tokens"] for r in warm),
        "prefix_cache_tokens": min(r["cached_tokens"] for r in floor),
        # The warm process's second runs: vLLM's own hit there (what its ratio divides by).
        "prefix_cache_same_process_tokens": min(
            r["cached_tokens"] for r in pooled["floor_same_process"]
        ),
        "outputs_match": all(
            w["token_ids"] == c["token_ids"] for w, c in zip(warm, cold, strict=True)
        ),
        # The same check of vLLM's own prefix-cache hit: where it also differs from cold,
        # the path of the computation (not the KV) changed a near-tie.
        "prefix_cache_outputs_match": all(
            f["token_ids"] == c["token_ids"] for f, c in zip(floor, cold, strict=True)
        ),
        "rounds": [_figures(one) for one in rounds],
        # What the node's handlers and copies took in the miss and the warm phases
        # (bench/node_figures.py); empty with --gateway (not the benchmark's node).
        "node": {
            phase: node_figures.figures({}, samples)
            for phase, samples in node_phases.items()
            if node_urls
        },
        # Every prompt's own figure, round by round: an outlier shows here, not in a median.
        "runs_ms": [
            {name: [round(r["ttft_s"] * 1e3, 1) for r in runs] for name, runs in one.items()}
            for one in rounds
        ],
        "parameters": {
            "model": args.model or "tiny random-weight Llama (kvmesh.engine.vllm.model)",
            "prompts": args.prompts,
            "output_tokens": 1,
            "kv_cache_gib": args.kv_cache_gib,
            "gateway": args.gateway or f"own fleet ({args.arrangement}), gateway's lane",
            "enforce_eager": True,
            "gap_s": args.gap_s,
            "rounds": args.rounds,
            "engine_timeout_s": args.engine_timeout_s,
            "node_realtime_priority": args.node_realtime_priority if fleet is not None else None,
        },
    }
    result["speedup_warm_vs_cold"] = round(result["ttft_cold_ms"] / result["ttft_warm_ms"], 1)
    return result


def format_table(result: dict[str, Any]) -> str:
    """The figures as text."""
    rows = [
        ("cold (vLLM alone, no prefix cache)", result["ttft_cold_ms"]),
        ("vLLM's own prefix-cache hit (floor)", result["ttft_prefix_cache_ms"]),
        ("kvmesh miss (empty cache, stores)", result["ttft_miss_ms"]),
        ("kvmesh warm (fresh vLLM process)", result["ttft_warm_ms"]),
    ]
    lines = [f"vLLM TTFT, {result['prompt_tokens']}-token prompt, 1 output token (median)"]
    lines += [f"  {name:<40} {ms:>9.1f} ms" for name, ms in rows]
    lines.append(
        f"  warm / floor {result['warm_over_prefix_cache']:.2f}x (target <= 1.2), "
        f"miss cost {result['miss_cost_fraction_of_cold'] * 100:+.1f} % of cold (target <= 3 %), "
        f"warm {result['speedup_warm_vs_cold']:.1f}x faster than cold"
    )
    lines.append(
        f"  tokens from kvmesh {result['tokens_from_cache']}, outputs match: "
        f"{result['outputs_match']}"
    )
    lines.append(
        f"  within one process: warm / its own prefix-cache hit "
        f"{result['warm_over_prefix_cache_same_process']:.2f}x, miss cost "
        f"{result['miss_cost_fraction_same_process'] * 100:+.1f} % of its own cold run "
        f"(medians of per-prompt ratios)"
    )
    for phase, node in result.get("node", {}).items():
        lines.append(f"  {phase}: {node_figures.describe(node)}")
    if len(result["rounds"]) > 1:
        for index, one in enumerate(result["rounds"], 1):
            lines.append(
                f"  round {index}: cold {one['ttft_cold_ms']:.1f}, floor "
                f"{one['ttft_prefix_cache_ms']:.1f}, miss {one['ttft_miss_ms']:.1f}, warm "
                f"{one['ttft_warm_ms']:.1f} ms; warm / floor {one['warm_over_prefix_cache']:.2f}x, "
                f"miss {one['miss_cost_fraction_of_cold'] * 100:+.1f} %; within one process "
                f"{one['warm_over_prefix_cache_same_process']:.2f}x, "
                f"{one['miss_cost_fraction_same_process'] * 100:+.1f} %"
            )
    return "\n".join(lines)
