"""The timed rounds: memcpy, store, retrieve and the direct kernel copies, interleaved.

The node's own calls (reserve, copy, publish/release) are timed inside the
server by :class:`_PhaseTimers`, so a round's time splits into phases; a
correctness check compares retrieved bytes with their source blocks first.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmesh import kernels
from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.bench.common import LoopThread, Progress, size_text
from kvmesh.common.dtypes import BY_SHORT
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.app import StorageApp
from kvmesh.storage.client import StorageClient

from .params import TARGET_RATIO, Shape


@dataclass
class _PhaseTimers:
    """Seconds spent in the node's own calls during one round, by phase."""

    seconds: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, obj: object, name: str, phase: str) -> None:
        """Time every call of ``obj.name`` (an instance attribute shadows the method)."""
        inner: Callable[..., Any] = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                with self.lock:
                    self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        with self.lock:
            out = dict(self.seconds)
            self.seconds.clear()
        return out


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _round(value: float, digits: int = 2) -> float:
    return round(value, digits)


def measure(
    args: argparse.Namespace,
    shape: Shape,
    per_request: int,
    loop: LoopThread,
    app: StorageApp,
    client: StorageClient,
    engine_path: str,
    engine_mem: np.ndarray[Any, Any],
    progress: Progress,
) -> dict[str, Any]:
    engine_id = "bench-engine"
    layout = common_pb2.KVLayout(
        kind=common_pb2.KV_LAYOUT_KIND_FLASH_ATTN,
        num_layers=shape.num_layers,
        num_blocks=shape.num_blocks,
        block_size=shape.block_size,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=BY_SHORT[shape.dtype].proto,  # type: ignore[arg-type]
    )
    layers = [
        common_pb2.MemoryHandle(
            shared_memory=common_pb2.SharedMemoryHandle(
                path=engine_path, offset_bytes=i * shape.layer_bytes, size_bytes=shape.layer_bytes
            )
        )
        for i in range(shape.num_layers)
    ]
    loop.run(
        client.register_engine_memory(
            storage_pb2.RegisterEngineMemoryRequest(
                engine_id=engine_id, layout=layout, layers=layers
            )
        )
    )

    rng = np.random.default_rng(args.seed)
    bpc = shape.blocks_per_chunk
    usable = shape.chunks * bpc  # the last chunk of blocks is the check's spare
    block_ids = [int(b) for b in rng.permutation(usable)]
    hashes = [rng.bytes(32) for _ in range(shape.chunks)]
    batches = [
        (hashes[i : i + per_request], block_ids[i * bpc : (i + per_request) * bpc])
        for i in range(0, shape.chunks, per_request)
    ]

    def keys(batch: list[bytes]) -> common_pb2.ChunkKeys:
        return common_pb2.ChunkKeys(model_name="bench/model", chunk_hashes=batch)

    async def store_round() -> None:
        for batch, ids in batches:
            response = await client.store_chunks(
                storage_pb2.StoreChunksRequest(
                    engine_id=engine_id,
                    keys=keys(batch),
                    block_ids=ids,
                    chunk_tokens=shape.chunk_tokens,
                ),
                timeout=600,
            )
            stored = sum(1 for o in response.outcomes if o == storage_pb2.STORE_OUTCOME_STORED)
            if stored != len(batch):
                raise RuntimeError(f"only {stored} of {len(batch)} chunks were stored")

    async def retrieve_round() -> None:
        for batch, ids in batches:
            response = await client.retrieve_chunks(
                storage_pb2.RetrieveChunksRequest(
                    engine_id=engine_id,
                    keys=keys(batch),
                    block_ids=ids,
                    chunk_tokens=shape.chunk_tokens,
                ),
                timeout=600,
            )
            if response.retrieved_chunks != len(batch):
                raise RuntimeError(f"retrieved {response.retrieved_chunks} of {len(batch)}")

    async def clear() -> None:
        await client.clear(storage_pb2.ClearRequest(force=True))

    # The direct kernel path: the same copies on the node's own transfer engine and
    # L1 objects, without gRPC or L1 bookkeeping.
    transfer = app.transfer
    manager = app.manager
    node_keys = _object_keys(hashes)  # the L1 keys of the stored chunks, in chunk order
    per_chunk_ids = [block_ids[i * bpc : (i + 1) * bpc] for i in range(shape.chunks)]

    def kernel_round(direction: str) -> float:
        manager.reserve_read(node_keys, 1)
        try:
            objects = manager.unsafe_read(node_keys)
            views = [objects[k].view() for k in node_keys]
            start = time.perf_counter()
            if direction == "gather":
                transfer.gather_chunks(
                    engine_id, per_chunk_ids, [shape.chunk_tokens] * shape.chunks, views
                )
            else:
                transfer.scatter_chunks(
                    engine_id, per_chunk_ids, [shape.chunk_tokens] * shape.chunks, views
                )
            return time.perf_counter() - start
        finally:
            manager.finish_read(node_keys, 1)

    src = np.empty(shape.chunk_bytes, dtype=np.uint8)
    dst = np.empty(shape.chunk_bytes, dtype=np.uint8)
    src.fill(1)
    dst.fill(2)

    def memcpy_round() -> float:
        start = time.perf_counter()
        for _ in range(shape.chunks):
            np.copyto(dst, src)
        return time.perf_counter() - start

    timers = _PhaseTimers()
    timers.wrap(transfer, "gather_chunks", "copy")
    timers.wrap(transfer, "scatter_chunks", "copy")
    timers.wrap(manager, "reserve_write", "l1_reserve")
    timers.wrap(manager, "finish_write", "l1_publish")
    timers.wrap(manager, "reserve_read", "l1_lock")
    timers.wrap(manager, "unsafe_read", "l1_lock")
    timers.wrap(manager, "finish_read", "l1_unlock")

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    # The first store meets a cold node: L1 holds one pre-faulted segment and grows
    # (and pre-faults) the rest on the request path, and the node's fresh mapping of
    # the engine file faults on first touch. Reported apart as cold_store_gbps.
    progress.phase("cold store: the first round, into an empty node")
    before = faults()
    start = time.perf_counter()
    loop.run(store_round())
    cold_s = time.perf_counter() - start
    cold_faults = faults() - before
    cold_phases = timers.take()

    # Then pre-fault the whole pool: no timed round may pay for fresh L1 pages.
    pool = manager.pool
    progress.phase(f"pre-faulting L1 ({size_text(pool.capacity_bytes)})")
    grow_start = time.perf_counter()
    pool.grow_for([pool.segment_bytes] * (pool.capacity_bytes // pool.segment_bytes))
    grow_s = time.perf_counter() - grow_start

    # Warm-up (not timed): the kernels' helper pool, index caches, the gRPC channel.
    progress.phase("warm-up (not timed): a checked retrieve, a retrieve round, a memcpy round")
    _check_retrieve(loop, client, engine_id, shape, hashes[0], per_chunk_ids[0], engine_mem)
    loop.run(retrieve_round())
    memcpy_round()
    timers.take()

    times: dict[str, list[float]] = {
        k: [] for k in ("memcpy", "store", "retrieve", "gather", "scatter")
    }
    phases: dict[str, list[dict[str, float]]] = {"store": [], "retrieve": []}
    fault_counts: dict[str, list[int]] = {"store": [], "retrieve": []}
    for rep in range(args.repetitions):
        progress.phase(
            f"repetition {rep + 1}/{args.repetitions}: memcpy, store, retrieve, kernel copies"
        )
        times["memcpy"].append(memcpy_round())

        loop.run(clear())
        timers.take()
        before = faults()
        start = time.perf_counter()
        loop.run(store_round())
        times["store"].append(time.perf_counter() - start)
        fault_counts["store"].append(faults() - before)
        phases["store"].append(timers.take())

        before = faults()
        start = time.perf_counter()
        loop.run(retrieve_round())
        times["retrieve"].append(time.perf_counter() - start)
        fault_counts["retrieve"].append(faults() - before)
        phases["retrieve"].append(timers.take())

        times["gather"].append(kernel_round("gather"))
        times["scatter"].append(kernel_round("scatter"))
        timers.take()

    loop.run(clear())
    total = shape.chunks * shape.chunk_bytes
    median = {k: _gbps(total, statistics.median(v)) for k, v in times.items()}
    best = {k: _gbps(total, min(v)) for k, v in times.items()}
    result: dict[str, Any] = {
        "store_gbps": _round(median["store"]),
        "retrieve_gbps": _round(median["retrieve"]),
        "memcpy_gbps": _round(median["memcpy"]),
        "store_ratio": _round(median["store"] / median["memcpy"], 3),
        "retrieve_ratio": _round(median["retrieve"] / median["memcpy"], 3),
        "best_store_gbps": _round(best["store"]),
        "best_retrieve_gbps": _round(best["retrieve"]),
        "best_memcpy_gbps": _round(best["memcpy"]),
        "best_store_ratio": _round(best["store"] / best["memcpy"], 3),
        "best_retrieve_ratio": _round(best["retrieve"] / best["memcpy"], 3),
        "kernel_gather_gbps": _round(median["gather"]),
        "kernel_scatter_gbps": _round(median["scatter"]),
        "chunk_bytes": shape.chunk_bytes,
        "chunks": shape.chunks,
        "repetitions": args.repetitions,
        "target_ratio": TARGET_RATIO,
        "breakdown_ms": {op: _breakdown(phases[op], times[op]) for op in ("store", "retrieve")},
        "minor_faults_per_round": {
            **{op: int(statistics.median(v)) for op, v in fault_counts.items()},
            "cold_store": cold_faults,
        },
        "cold_store_gbps": _round(_gbps(total, cold_s)),
        "cold_store_breakdown_ms": _breakdown([cold_phases], [cold_s]),
        "parameters": {
            "chunk_tokens": shape.chunk_tokens,
            "num_layers": shape.num_layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "block_size": shape.block_size,
            "dtype": shape.dtype,
            "layout": "flash_attn",
            "chunks_per_request": per_request,
            "copy_threads": kernels.copy_threads(),
            # The node caps a store's copy (store_copy_threads; 0 = no cap).
            "store_copy_threads": min(
                kernels.copy_threads(), args.store_copy_threads or kernels.copy_threads()
            ),
            "l1_bytes": int(app.manager.pool.capacity_bytes),
            "l1_prefault_s": _round(grow_s, 3),
            "engine_bytes": shape.layer_bytes * shape.num_layers,
            "cpu_count": os.cpu_count(),
            "seed": args.seed,
        },
    }
    return result


def _object_keys(batch: list[bytes]) -> list[ObjectKey]:
    """The node's keys of a batch (what ChunkKeys(model_name="bench/model") names)."""
    return [ObjectKey(h, "bench/model", 0, 0, "") for h in batch]


def _breakdown(rounds: list[dict[str, float]], totals: list[float]) -> dict[str, float]:
    """Median milliseconds per phase of one round; ``other`` = gRPC, asyncio, hand-offs."""
    order = sorted(range(len(totals)), key=lambda i: totals[i])
    mid = order[len(order) // 2]  # the median round, so the phases add up to its total
    phases = rounds[mid]
    out = {name: _round(seconds * 1e3, 2) for name, seconds in sorted(phases.items())}
    out["total"] = _round(totals[mid] * 1e3, 2)
    out["other"] = _round((totals[mid] - sum(phases.values())) * 1e3, 2)
    return out


def _check_retrieve(
    loop: LoopThread,
    client: StorageClient,
    engine_id: str,
    shape: Shape,
    chunk_hash: bytes,
    source_blocks: list[int],
    engine_mem: np.ndarray[Any, Any],
) -> None:
    """Retrieve one stored chunk into the spare blocks and compare bytes with its source."""
    bpc = shape.blocks_per_chunk
    spare = list(range(shape.chunks * bpc, (shape.chunks + 1) * bpc))
    response = loop.run(
        client.retrieve_chunks(
            storage_pb2.RetrieveChunksRequest(
                engine_id=engine_id,
                keys=common_pb2.ChunkKeys(model_name="bench/model", chunk_hashes=[chunk_hash]),
                block_ids=spare,
                chunk_tokens=shape.chunk_tokens,
            )
        )
    )
    if response.retrieved_chunks != 1:
        raise RuntimeError("the correctness check could not retrieve its chunk")
    block_bytes = shape.block_size * shape.kv_heads * shape.head_dim * shape.itemsize
    raw = engine_mem.view(np.uint8).reshape(shape.num_layers, 2, shape.num_blocks, block_bytes)
    if not np.array_equal(raw[:, :, spare], raw[:, :, source_blocks]):
        raise RuntimeError("retrieved bytes differ from the stored blocks")
