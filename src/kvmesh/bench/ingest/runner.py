"""Run ``kvmesh bench ingest``: one run per ``--window`` value.

Each run gets a fresh coordinator; the emitters stream, then lookups and
stats are timed.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import queue
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvmesh.api.coordinator.v1 import directory_pb2, directory_pb2_grpc
from kvmesh.bench.common import Progress, cpu_seconds
from kvmesh.common.convert import key_to_proto
from kvmesh.common.keys import ObjectKey

from .emitter import EmitterJob, EmitterResult, emitter_main
from .params import TARGETS
from .server import CoordinatorProcess, coordinator_process, rss_bytes


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _max_gap_ms(times_ns: Sequence[int]) -> float:
    s = sorted(times_ns)
    return max((b - a for a, b in itertools.pairwise(s)), default=0) / 1e6


def _stream(
    jobs: Sequence[EmitterJob], coordinator: CoordinatorProcess, progress: Progress, tag: str
) -> list[EmitterResult]:
    """Run every emitter process to completion; their results by index."""
    ctx = mp.get_context("spawn")  # no fork of a process that holds gRPC state
    ready = ctx.Queue()
    results = ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(target=emitter_main, args=(job, ready, go, results), daemon=True)
        for job in jobs
    ]
    try:
        progress.phase(
            f"{tag}starting {len(jobs)} emitter processes (each serializes its batches)",
            len(jobs),
            "ready",
        )
        for p in procs:
            p.start()
        for started in range(len(jobs)):
            index, error = ready.get(timeout=300)
            if error:
                raise RuntimeError(f"emitter {index} could not start: {error}")
            progress.count(started + 1)
        keys = sum(job.batches * job.batch_entries for job in jobs)
        progress.phase(f"{tag}streaming {keys:,} keys", len(jobs), "emitters finished")
        go.set()
        out: list[EmitterResult] = []
        while len(out) < len(jobs):
            try:
                out.append(results.get(timeout=1.0))
                progress.count(len(out))
            except queue.Empty:
                if coordinator.proc.poll() is not None:
                    raise RuntimeError(
                        f"the coordinator died during ingest:\n{coordinator.log_tail()}"
                    ) from None
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("an emitter process failed") from None
        for p in procs:
            p.join(timeout=30)
        errors = [r.error for r in out if r.error]
        if errors:
            raise RuntimeError("; ".join(errors))
        return sorted(out, key=lambda r: r.index)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _lookups(
    target: str, sample: Sequence[ObjectKey], n: int, seed: int, progress: Progress, tag: str
) -> list[float]:
    """Latencies (s) of ``n`` 16-key lookups of stored keys; every key must have a placement."""
    rng = random.Random(seed)
    requests = [
        directory_pb2.LookupRequest(
            keys=directory_pb2.KeyList(keys=[key_to_proto(k) for k in rng.sample(sample, 16)])
        )
        for _ in range(n)
    ]
    latencies: list[float] = []
    with grpc.insecure_channel(target) as channel:
        stub = directory_pb2_grpc.DirectoryServiceStub(channel)
        stub.Lookup(requests[0], timeout=10, wait_for_ready=True)  # connect first
        progress.phase(f"{tag}timing {n} 16-key directory lookups", n)
        perf = time.perf_counter
        for done, request in enumerate(requests, 1):
            t0 = perf()
            response = stub.Lookup(request, timeout=2)
            latencies.append(perf() - t0)
            progress.count(done)
            if not all(r.placements for r in response.results):
                raise RuntimeError("a stored key has no placement in the directory")
    return latencies


def _stats(target: str) -> directory_pb2.GetStatsResponse:
    with grpc.insecure_channel(target) as channel:
        stub = directory_pb2_grpc.DirectoryServiceStub(channel)
        response: directory_pb2.GetStatsResponse = stub.GetStats(
            directory_pb2.GetStatsRequest(), timeout=10, wait_for_ready=True
        )
        return response


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One run per ``--window`` value.

    The top level holds the first run's figures (``entries_per_s``,
    ``ack_p50_ms``, ``ack_p99_ms``, ``max_stall_ms``, ``lookup16_p50_ms``,
    ``lookup16_p99_ms``, ``bytes_per_key`` and the parameters); with several
    windows, ``runs`` lists every run's figures, the first one included.
    """
    windows = list(args.window)
    if (
        args.emitters < 1
        or args.batch_entries < 1
        or not windows
        or min(windows) < 1
        or args.keys < 1
        or args.group < 0
    ):
        raise ValueError(
            "--emitters, --batch-entries, --window and --keys must be >= 1, --group >= 0"
        )
    with Progress.for_args("ingest", args) as progress:
        progress.say(
            f"{len(windows)} run(s) (window {' then '.join(map(str, windows))}), each "
            f"{args.emitters} emitters x {args.batch_entries}-entry batches, {args.keys:,} keys"
        )
        runs = []
        for index, window in enumerate(windows, 1):
            tag = f"run {index}/{len(windows)} (window {window}): "
            runs.append(_run_one(args, window, progress, tag))
    if len(runs) == 1:
        return runs[0]
    return {**runs[0], "runs": runs}


def _run_one(
    args: argparse.Namespace, window: int, progress: Progress, tag: str = ""
) -> dict[str, Any]:
    """Start the coordinator and the emitters, measure, stop everything; the figures."""
    # Groups never exceed what the window lets out at once.
    group = min(window, args.group or window)
    per_emitter = max(1, args.keys // (args.emitters * args.batch_entries))
    progress.phase(f"{tag}starting the coordinator")
    with (
        tempfile.TemporaryDirectory(prefix="kvmesh-bench-ingest-") as tmp,
        coordinator_process(Path(tmp), args.coordinator_arg) as coordinator,
    ):
        pid = coordinator.proc.pid
        _stats(coordinator.target)  # the server has answered once: its baseline is warm
        rss0 = rss_bytes(pid)
        jobs = [
            EmitterJob(
                i,
                coordinator.target,
                per_emitter,
                args.batch_entries,
                window,
                group,
                args.l1_share,
                args.tokens,
                args.seed,
            )
            for i in range(args.emitters)
        ]
        cpu0 = cpu_seconds(pid)
        results = _stream(jobs, coordinator, progress, tag)
        cpu1 = cpu_seconds(pid)
        stats = _stats(coordinator.target)
        rss1 = rss_bytes(pid)
        sample = [k for r in results for k in r.sample]
        lookups = _lookups(coordinator.target, sample, args.lookups, args.seed, progress, tag)
        progress.phase(f"{tag}stopping the coordinator")
    first = min(r.send_ns[0] for r in results)
    last = max(max(r.ack_ns) for r in results)
    latencies_ms = [
        (a - s) / 1e6 for r in results for s, a in zip(r.send_ns, r.ack_ns, strict=True)
    ]
    entries = sum(len(r.ack_ns) for r in results) * args.batch_entries
    seconds = (last - first) / 1e9
    lookup_ms = [x * 1e3 for x in lookups]
    cpu_s = cpu1 - cpu0
    result: dict[str, Any] = {
        "entries_per_s": entries / seconds,
        "ack_p50_ms": _pct(latencies_ms, 0.50),
        "ack_p99_ms": _pct(latencies_ms, 0.99),
        "ack_max_ms": max(latencies_ms),
        "ack_mean_ms": statistics.fmean(latencies_ms),
        "max_stall_ms": _max_gap_ms([t for r in results for t in r.ack_ns]),
        "max_stall_per_emitter_ms": max(_max_gap_ms(r.ack_ns) for r in results),
        "lookup16_p50_ms": _pct(lookup_ms, 0.50),
        "lookup16_p99_ms": _pct(lookup_ms, 0.99),
        "bytes_per_key": (rss1 - rss0) / max(1, stats.num_keys),
        "num_keys": stats.num_keys,
        "coordinator_rss_mb": rss1 / 1e6,
        "coordinator_cpu_s": cpu_s,
        "entries_per_coordinator_cpu_s": entries / cpu_s if cpu_s > 0 else 0.0,
        "emitters_cpu_s": sum(r.cpu_s for r in results),
        "ingest_seconds": seconds,
        "batches_admitted": sum(r.admitted for r in results),
        "batches_sent": sum(len(r.ack_ns) for r in results),
        "messages_sent": sum(r.messages for r in results),
        "batches_per_message": sum(len(r.ack_ns) for r in results)
        / max(1, sum(r.messages for r in results)),
        "emitters": args.emitters,
        "batch_entries": args.batch_entries,
        "keys": entries,
        "window": window,
        "group": group,
        "parameters": {
            "emitters": args.emitters,
            "batch_entries": args.batch_entries,
            "keys": entries,
            "window": window,
            "group": group,
            "l1_share": args.l1_share,
            "tokens": args.tokens,
            "lookups": args.lookups,
            "cpus": os.cpu_count(),
        },
        "targets": TARGETS,
    }
    result["targets_met"] = {
        "entries_per_s": result["entries_per_s"] >= TARGETS["entries_per_s"],
        "ack_p99_ms": result["ack_p99_ms"] <= TARGETS["ack_p99_ms"],
        "max_stall_ms": result["max_stall_ms"] <= TARGETS["max_stall_ms"],
    }
    return result
