"""Run ``kvmesh bench lookup``: every arrangement, then the optional profile pass.

Each arrangement runs in temporary directories of its own, removed also on
failure; :func:`run` returns the figures as one JSON-serializable dict.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvmesh.bench.common import Progress

from .params import ARRANGEMENTS, TARGET_LOOKUP_P50_MS, Endpoints, Params
from .profiling import profile_summary
from .servers import in_process, node_process, processes
from .workload import engine_file, measure


def _arrangement(
    name: str,
    params: Params,
    shm_dir: str,
    progress: Progress,
    profile_dir: Path | None = None,
    client_profile: cProfile.Profile | None = None,
) -> dict[str, Any]:
    work_dir = Path(tempfile.mkdtemp(prefix="kvmesh-bench-lookup-", dir=shm_dir))
    data_dir = Path(tempfile.mkdtemp(prefix="kvmesh-bench-lookup-"))
    try:
        with engine_file(work_dir, params) as engine:
            servers: contextlib.AbstractContextManager[Endpoints]
            if name in ("processes", "processes-lane"):
                lane = name == "processes-lane"
                servers = processes(params, work_dir, data_dir, profile_dir, lane=lane)
            elif name in ("node", "node-lane"):
                servers = node_process(params, work_dir, data_dir, lane=name == "node-lane")
            else:
                servers = in_process(params, work_dir, data_dir)
            label = f"[{name}{', under cProfile' if profile_dir else ''}] "
            progress.phase(f"{label}starting the servers")
            with servers as endpoints:
                figures = measure(endpoints, params, engine, client_profile, progress, label)
                progress.phase(f"{label}stopping the servers")
            return figures
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)


def _profile_pass(params: Params, shm_dir: str, top: int, progress: Progress) -> dict[str, Any]:
    """Servers (own processes) and the client loop under cProfile; where their time goes.

    Client and servers are profiled over the timed lookups + EndSessions only
    (the servers' loop threads, switched on and off by signals), minus idle
    waits; figures are divided by the number of timed lookups.
    """
    profile_dir = Path(tempfile.mkdtemp(prefix="kvmesh-bench-lookup-prof-"))
    try:
        client_profile = cProfile.Profile()
        figures = _arrangement("processes", params, shm_dir, progress, profile_dir, client_profile)
        client_profile.create_stats()
        per = params.iterations
        out: dict[str, Any] = {
            "note": "a separate pass under cProfile (every figure inflated by it): busy µs "
            "per timed lookup + EndSession by part of the stack (servers: their loop "
            "thread), idle waits left out",
            "profiled_lookup_p50_ms": figures["lookup"]["p50_ms"],
            "client": profile_summary(pstats.Stats(client_profile), top, per),
        }
        for name in ("gateway", "storage"):
            path = profile_dir / f"{name}.prof"
            if path.exists():
                out[name] = profile_summary(pstats.Stats(str(path)), top, per)
        return out
    finally:
        shutil.rmtree(profile_dir, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the figures and the parameters (JSON-serializable)."""
    params = Params(
        chunks=args.chunks,
        chunk_tokens=args.chunk_tokens,
        iterations=args.iterations,
        warmup=args.warmup,
        num_layers=args.num_layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        seed=args.seed,
        storage_transport=args.storage_transport,
        hash_memo_entries=args.hash_memo_entries,
    )
    if params.chunks < 1 or params.iterations < 1 or params.warmup < 0:
        raise ValueError("--chunks and --iterations must be >= 1, --warmup >= 0")
    if params.chunk_tokens % params.block_size:
        raise ValueError("--chunk-tokens must be a multiple of --block-size")
    names = list(ARRANGEMENTS) if args.arrangement == "all" else [args.arrangement]
    with Progress.for_args("lookup", args) as progress:
        progress.say(
            f"{len(names)} arrangement(s): {', '.join(names)}; {params.iterations} timed calls "
            f"per figure after {params.warmup} untimed"
        )
        arrangements = {name: _arrangement(name, params, args.shm_dir, progress) for name in names}
        profile = (
            _profile_pass(params, args.shm_dir, args.profile_top, progress)
            if args.profile
            else None
        )
    headline = arrangements[names[0]]
    result: dict[str, Any] = {
        "lookup_p50_ms": headline["lookup"]["p50_ms"],
        "lookup_p99_ms": headline["lookup"]["p99_ms"],
        "empty_rtt_p50_ms": headline["get_chunk_size"]["p50_ms"],
        "headline_arrangement": names[0],
        "target_lookup_p50_ms": TARGET_LOOKUP_P50_MS,
        "meets_target": headline["lookup"]["p50_ms"] <= TARGET_LOOKUP_P50_MS,
        "chunks": params.chunks,
        "tokens": params.tokens,
        "iterations": params.iterations,
        "parameters": {
            "chunk_tokens": params.chunk_tokens,
            "warmup": params.warmup,
            "num_layers": params.num_layers,
            "kv_heads": params.kv_heads,
            "head_dim": params.head_dim,
            "block_size": params.block_size,
            "dtype": "fp16",
            "hash_memo_entries": params.hash_memo_entries,
            "lookup": "new request_id per iteration, wait_timeout_ms 5000, prefix in L1, "
            "then EndSession (timed separately)",
            "transport": "engine -> gateway: the local lane (unix socket) in node-lane and "
            "processes-lane, gRPC over TCP loopback otherwise; gateway -> storage: in-process "
            "in node and node-lane, the local lane in processes-lane, else gRPC over "
            + ("a unix socket" if params.storage_transport == "unix" else "TCP loopback"),
        },
        "arrangements": arrangements,
    }
    if profile is not None:
        result["profile"] = profile
    return result
