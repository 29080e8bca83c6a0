"""Options of ``kvmesh bench route`` and the fixed sizes of its fleet."""

from __future__ import annotations

import argparse
import os

from kvmesh.bench.common import add_model_argument

ROUTERS = ("score", "round_robin", "oracle")
#: Engines (each a vLLM server with a kvmesh node of its own).
ENGINES = 2
#: Tokens per kvmesh chunk: the coordinator's and the nodes' --chunk-size.
CHUNK = 256
#: vLLM's KV block size (it must divide the chunk size).
BLOCK_SIZE = 128


def default_omp_binds(cores: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND of each engine, ';'-separated: the same number of cores each.

    One core is left to kvmesh and the client where there are more than two;
    on two cores each engine gets one.
    """
    per_engine = max(1, (cores - 1) // ENGINES)
    binds = []
    for engine in range(ENGINES):
        first = (engine * per_engine) % cores
        last = first + per_engine - 1
        binds.append(str(first) if per_engine == 1 else f"{first}-{last}")
    return ";".join(binds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmesh bench route``."""
    add_model_argument(parser)
    parser.add_argument("--groups", type=int, default=6, help="prefix groups (G)")
    parser.add_argument(
        "--prefix-tokens", type=int, default=2048, help="tokens of a group's shared prefix (L)"
    )
    parser.add_argument(
        "--requests-per-group", type=int, default=4, help="requests of each group (R)"
    )
    parser.add_argument(
        "--suffix-tokens", type=int, default=64, help="tokens of each request's own suffix (S)"
    )
    parser.add_argument("--output-tokens", type=int, default=8, help="tokens per answer")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight (C)")
    parser.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        help="which routers to run, comma-separated, in this order",
    )
    parser.add_argument(
        "--l1-size", default="4GiB", help="each kvmesh node's L1 size (grown as needed)"
    )
    parser.add_argument(
        "--p2p",
        action="store_true",
        help="let the nodes fetch prefixes from each other; off, an engine finds only what "
        "was sent to it (the oracle's model of a cache)",
    )
    parser.add_argument(
        "--omp-binds",
        default=default_omp_binds(os.cpu_count() or 1),
        help="VLLM_CPU_OMP_THREADS_BIND of each engine, ';'-separated: the cores its threads "
        "run on (vLLM's OpenMP threads spin, so two engines on one core stall each other)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and their order")


def chosen_routers(args: argparse.Namespace) -> list[str]:
    """Check the options; the routers to run, in order (SystemExit on a bad option)."""
    chosen = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = sorted(set(chosen) - set(ROUTERS))
    if unknown or not chosen or len(set(chosen)) != len(chosen):
        raise SystemExit(f"kvmesh bench route: --routers takes {', '.join(ROUTERS)}, each once")
    for name in ("groups", "requests_per_group", "suffix_tokens", "output_tokens", "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvmesh bench route: --{name.replace('_', '-')} must be >= 1")
    if args.prefix_tokens < CHUNK:
        raise SystemExit(f"kvmesh bench route: --prefix-tokens must be >= {CHUNK} (one chunk)")
    if len(omp_binds(args)) != ENGINES:
        raise SystemExit(f"kvmesh bench route: --omp-binds names {ENGINES} engines' cores")
    return chosen


def omp_binds(args: argparse.Namespace) -> list[str]:
    """Each engine's VLLM_CPU_OMP_THREADS_BIND."""
    return [b.strip() for b in args.omp_binds.split(";") if b.strip()]
