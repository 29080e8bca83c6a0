"""The timed workload: register an engine, store the prompt, time lookups and round trips.

The servers' own RPC metrics are scraped before and after the timed loop, so
the figures say how much of a round trip is the handlers' time.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import re
import signal
import statistics
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.bench.common import Progress
from kvmesh.gateway.client import GatewayClient

from .params import MODEL, Endpoints, Params

# Server-side methods whose mean handler time explains a lookup's round trip.
_GATEWAY_METHODS = ("Lookup", "EndSession", "GetChunkSize")
_STORAGE_METHODS = ("LookupAndLock", "ReleaseLocks", "TouchKeys")


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        os.kill(pid, signum)


@contextlib.contextmanager
def engine_file(work_dir: Path, params: Params) -> Iterator[Path]:
    """The engine's KV cache file with random values, removed at exit."""
    path = work_dir / f"engine-{uuid.uuid4().hex[:8]}-kv"
    total = params.layer_bytes * params.num_layers
    with open(path, "wb") as f:
        f.truncate(total)
    mem = np.memmap(path, dtype=np.uint8, mode="r+", shape=(total,))
    mem[:] = np.random.default_rng(params.seed).integers(0, 255, total, dtype=np.uint8)
    mem.flush()
    del mem
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _register_and_store(client: GatewayClient, params: Params, engine: Path) -> list[int]:
    """Register the engine, store the prompt; the prompt's tokens."""
    layout = common_pb2.KVLayout(
        kind=common_pb2.KV_LAYOUT_KIND_FLASH_ATTN,
        num_layers=params.num_layers,
        num_blocks=params.num_blocks,
        block_size=params.block_size,
        kv_heads=params.kv_heads,
        head_dim=params.head_dim,
        dtype=common_pb2.DTYPE_FLOAT16,
    )
    layers = [
        common_pb2.MemoryHandle(
            shared_memory=common_pb2.SharedMemoryHandle(
                path=str(engine),
                offset_bytes=i * params.layer_bytes,
                size_bytes=params.layer_bytes,
            )
        )
        for i in range(params.num_layers)
    ]
    client.register_kv_cache(
        gateway_pb2.RegisterKVCacheRequest(
            engine_id="bench-engine",
            model_name=MODEL,
            world_size=1,
            worker_id=0,
            layout=layout,
            layers=layers,
        ),
        wait_for_ready=True,
    )
    rng = np.random.default_rng(params.seed)
    tokens = [int(t) for t in rng.integers(0, 128_000, params.tokens)]
    stored = client.store(
        gateway_pb2.StoreRequest(
            engine_id="bench-engine",
            range=gateway_pb2.PromptRange(
                request_id="bench-writer",
                model_name=MODEL,
                world_size=1,
                token_ids=tokens,
                start_token=0,
                end_token=params.tokens,
            ),
            block_ids=list(range(params.num_blocks)),
        )
    )
    client.end_session(gateway_pb2.EndSessionRequest(request_id="bench-writer"))
    if stored.stored_chunks + stored.already_cached_chunks != params.chunks:
        raise RuntimeError(f"storing the prompt stored only {stored.stored_chunks} chunks")
    return tokens


def _ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return round(ordered[index] * 1000.0, 4)


def _summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": _ms(samples, 0.50),
        "p90_ms": _ms(samples, 0.90),
        "p99_ms": _ms(samples, 0.99),
        "mean_ms": round(statistics.fmean(samples) * 1000.0, 4),
        "max_ms": _ms(samples, 1.0),
    }


_SERIES = re.compile(
    r'^kvmesh_rpc_latency_seconds_(sum|count)\{[^}]*method="(?P<method>[^"]+)"[^}]*\}\s+(?P<v>\S+)$'
)


def _scrape(address: str) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) of the RPC latency histogram per method, from ``/metrics``."""
    if not address:
        return {}
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = _SERIES.match(line)
        if match:
            pair = out.setdefault(match["method"], [0.0, 0.0])
            pair[0 if match.group(1) == "sum" else 1] = float(match["v"])
    return {method: (pair[0], pair[1]) for method, pair in out.items()}


def _handler_means(
    before: dict[str, tuple[float, float]],
    after: dict[str, tuple[float, float]],
    methods: tuple[str, ...],
) -> dict[str, float]:
    """Mean handler milliseconds per method over the calls between two scrapes."""
    out: dict[str, float] = {}
    for method in methods:
        s1, c1 = after.get(method, (0.0, 0.0))
        s0, c0 = before.get(method, (0.0, 0.0))
        if c1 > c0:
            out[method] = round((s1 - s0) / (c1 - c0) * 1000.0, 4)
    return out


def measure(
    endpoints: Endpoints,
    params: Params,
    engine: Path,
    client_profile: cProfile.Profile | None,
    progress: Progress,
    label: str = "",
) -> dict[str, Any]:
    """Register, store, then time lookups, re-lookups and empty round trips.

    Progress lines start with ``label`` (the arrangement's name).
    """
    client = GatewayClient(endpoints.gateway)
    try:
        progress.phase(f"{label}registering the engine, storing the {params.chunks}-chunk prompt")
        tokens = _register_and_store(client, params, engine)
        # Built once per prompt, as an engine reuses its token array; only the id changes.
        lookup = gateway_pb2.LookupRequest(
            request_id="",
            model_name=MODEL,
            world_size=1,
            token_ids=tokens,
            wait_timeout_ms=5000,
        )
        end = gateway_pb2.EndSessionRequest()
        clock = time.perf_counter

        def new_request(i: int, lookups: list[float], ends: list[float]) -> None:
            request_id = f"bench-{i}"
            lookup.request_id = request_id
            end.request_id = request_id
            t0 = clock()
            response = client.lookup(lookup)
            t1 = clock()
            client.end_session(end)
            t2 = clock()
            if response.status.hit_chunks != params.chunks:
                raise RuntimeError(
                    f"lookup hit {response.status.hit_chunks} of {params.chunks} chunks"
                )
            lookups.append(t1 - t0)
            ends.append(t2 - t1)

        scratch: list[float] = []
        progress.phase(f"{label}warm-up: {params.warmup} untimed lookups", params.warmup)
        for i in range(params.warmup):
            new_request(-1 - i, scratch, scratch)
            progress.count(i + 1)
        g0, s0 = _scrape(endpoints.gateway_metrics), _scrape(endpoints.storage_metrics)
        lookups: list[float] = []
        ends: list[float] = []
        progress.phase(f"{label}timed lookups + EndSession", params.iterations)
        _signal(endpoints.profiled_pids, signal.SIGUSR1)
        if client_profile is not None:
            client_profile.enable()
        for i in range(params.iterations):
            new_request(i, lookups, ends)
            if i % 64 == 63:  # seldom: a profiled pass must not list it
                progress.count(i + 1)
        if client_profile is not None:
            client_profile.disable()
        _signal(endpoints.profiled_pids, signal.SIGUSR2)
        g1, s1 = _scrape(endpoints.gateway_metrics), _scrape(endpoints.storage_metrics)

        lookup.request_id = "bench-same"
        progress.phase(f"{label}timed re-lookups of one request", params.iterations)
        client.lookup(lookup)
        relookups: list[float] = []
        for i in range(params.iterations):
            t0 = clock()
            client.lookup(lookup)
            relookups.append(clock() - t0)
            progress.count(i + 1)
        client.end_session(gateway_pb2.EndSessionRequest(request_id="bench-same"))

        chunk_size = gateway_pb2.GetChunkSizeRequest()
        ping = gateway_pb2.PingRequest()
        empties: dict[str, list[float]] = {"get_chunk_size": [], "ping": []}
        rounds = params.warmup + params.iterations
        progress.phase(f"{label}empty round trips (GetChunkSize, Ping)", rounds)
        for i in range(rounds):
            t0 = clock()
            client.get_chunk_size(chunk_size)
            t1 = clock()
            client.ping(ping)
            t2 = clock()
            if i >= params.warmup:
                empties["get_chunk_size"].append(t1 - t0)
                empties["ping"].append(t2 - t1)
            progress.count(i + 1)
        g2 = _scrape(endpoints.gateway_metrics)
        gateway_means = _handler_means(g0, g1, _GATEWAY_METHODS)
        gateway_means.update(_handler_means(g1, g2, ("GetChunkSize",)))
        return {
            "lookup": _summary(lookups),
            "end_session": _summary(ends),
            "relookup": _summary(relookups),
            "get_chunk_size": _summary(empties["get_chunk_size"]),
            "ping": _summary(empties["ping"]),
            "server_mean_ms": {
                "gateway": gateway_means,
                "storage": _handler_means(s0, s1, _STORAGE_METHODS),
            },
        }
    finally:
        client.close()
