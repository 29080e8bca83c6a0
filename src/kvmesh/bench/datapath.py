"""``kvmesh bench datapath``: store and retrieve throughput through a real storage service.

DESIGN §7: store (engine → L1) and retrieve (L1 → engine) must reach 85 % of
a one-thread memcpy of the same bytes measured in the same run; LMCache 0.5.6
does 4.3–4.6 GB/s store and about 4.0 GB/s retrieve on this machine kind.

What runs: a storage node (``StorageApp`` through the chassis
``create_server``, L2 ``none``) on a loopback port of this process, its L1
pool grown to full size and pre-faulted before anything is timed, and an
engine KV cache in a /dev/shm file (flash-attn layout, block size 16)
registered with ``RegisterEngineMemory``. Chunks are 256 tokens × 32 layers
× 8 kv heads × 128 head_dim × bf16 = 32 MiB by default, on random distinct
block ids, as a paged cache hands them out. Each repetition, interleaved so
machine noise hits every method alike:

- ``memcpy``: ``np.copyto`` between two pre-faulted 32 MiB buffers, once per
  chunk (one thread, glibc memcpy);
- ``store``: ``Clear(force)`` (not timed), then ``StoreChunks`` of every chunk
  through the typed gRPC client;
- ``retrieve``: ``RetrieveChunks`` of every chunk into the engine's blocks;
- ``kernel``: the same copies called directly on the node's transfer engine
  (no gRPC, no L1 bookkeeping), which separates the node's overhead from the
  copy kernels'.

Figures are GB/s (10^9 bytes) of chunk bytes; the headline figures are the
median repetition, the best repetition is reported too. Where the time of a
store or retrieve RPC goes is measured by timing the node's own calls
(reserve, copy, publish/release) inside the server, and page faults by the
process's minor-fault counter around each round.

Memory: the engine file (chunks + one spare chunk of blocks) plus L1 (chunks
+ one segment) plus 64 MiB; about 1.2 GiB with the defaults. Every file this
creates is removed, also on failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from prometheus_client import CollectorRegistry

from kvmesh import kernels
from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.bench.common import LoopThread
from kvmesh.common.dtypes import BY_SHORT
from kvmesh.common.keys import ObjectKey
from kvmesh.rpc.server import Server, create_server
from kvmesh.storage.app import StorageApp
from kvmesh.storage.client import StorageClient
from kvmesh.storage.config import StorageConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: DESIGN §7 target and the LMCache 0.5.6 figures measured on this machine kind.
TARGET_RATIO = 0.85
LMCACHE_REFERENCE = {"store_gbps": "4.3-4.6", "retrieve_gbps": "4.0"}

_MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmesh bench datapath``."""
    parser.add_argument("--chunks", type=int, default=16, help="chunks moved per round")
    parser.add_argument("--repetitions", type=int, default=5, help="timed rounds")
    parser.add_argument(
        "--chunks-per-request",
        type=int,
        default=0,
        help="chunks per StoreChunks/RetrieveChunks (0 = all chunks in one request)",
    )
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument(
        "--copy-threads",
        type=int,
        default=0,
        help="threads one copy may use (0 = the kernels' default: torch's thread count)",
    )
    parser.add_argument(
        "--shm-dir", default="/dev/shm", help="where the engine file and L1 segments live"
    )
    parser.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class _Shape:
    chunks: int
    chunk_tokens: int
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return BY_SHORT[self.dtype].itemsize

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def num_blocks(self) -> int:
        # One spare chunk of blocks: the correctness check retrieves into it.
        return (self.chunks + 1) * self.blocks_per_chunk

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_size * self.kv_heads * self.head_dim * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        return (
            2
            * self.num_layers
            * self.chunk_tokens
            * self.kv_heads
            * self.head_dim
            * (self.itemsize)
        )


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


@contextmanager
def _engine_file(directory: str, shape: _Shape) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
    """The engine's KV cache file, every page written (so faulted in), removed at exit."""
    path = os.path.join(directory, f"engine-{uuid.uuid4().hex[:8]}-kv")
    total = shape.layer_bytes * shape.num_layers
    try:
        with open(path, "wb") as f:
            f.truncate(total)
        mem = np.memmap(path, dtype=np.uint64, mode="r+", shape=(total // 8,))
        # Distinct values everywhere: a copy that moved the wrong block shows up. In
        # 32 MiB steps, so filling never holds a second copy of the whole cache.
        step = 4 * _MIB
        for lo in range(0, mem.size, step):
            hi = min(lo + step, mem.size)
            mem[lo:hi] = np.arange(lo, hi, dtype=np.uint64)
        try:
            yield path, mem
        finally:
            del mem
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _round(value: float, digits: int = 2) -> float:
    return round(value, digits)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the figures and the parameters (JSON-serializable)."""
    shape = _Shape(
        chunks=args.chunks,
        chunk_tokens=args.chunk_tokens,
        num_layers=args.num_layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=args.dtype,
    )
    if shape.chunks < 1 or args.repetitions < 1:
        raise ValueError("--chunks and --repetitions must be >= 1")
    if shape.chunk_tokens % shape.block_size:
        raise ValueError("--chunk-tokens must be a multiple of --block-size")
    per_request = args.chunks_per_request or shape.chunks
    if args.copy_threads:
        kernels.set_copy_threads(args.copy_threads)
    work_dir = tempfile.mkdtemp(prefix="kvmesh-bench-datapath-", dir=args.shm_dir)
    data_dir = tempfile.mkdtemp(prefix="kvmesh-bench-datapath-")
    try:
        with _engine_file(work_dir, shape) as (engine_path, engine_mem):
            return _run(args, shape, per_request, work_dir, data_dir, engine_path, engine_mem)
    finally:
        if args.copy_threads:
            kernels.set_copy_threads(None)
        shutil.rmtree(work_dir, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)


def _run(
    args: argparse.Namespace,
    shape: _Shape,
    per_request: int,
    work_dir: str,
    data_dir: str,
    engine_path: str,
    engine_mem: np.ndarray[Any, Any],
) -> dict[str, Any]:
    # L1 = every chunk plus one segment, so a full round never reaches the eviction
    # watermark (eviction would turn a store into a measurement of the evictor).
    segment = max(4 * shape.chunk_bytes, 64 * _MIB)
    l1_bytes = (math.ceil(shape.chunks * shape.chunk_bytes / segment) + 1) * segment
    config = StorageConfig(
        port=0,
        metrics_port=-1,
        grace_seconds=1.0,
        instance_id=f"bench-{uuid.uuid4().hex[:8]}",
        data_dir=data_dir,
        l1_size_bytes=l1_bytes,
        l1_segment_bytes=segment,
        shm_dir=work_dir,
        allowed_memory_dir=work_dir,
        l2=["none"],
        eviction_watermark=0.95,
        max_chunks_per_request=max(4096, shape.chunks),
        log_level="WARNING",
    )
    loop = LoopThread("kvmesh-bench-loop")
    server: Server | None = None
    client: StorageClient | None = None
    try:

        async def start() -> tuple[Server, StorageClient]:
            srv = create_server(config, StorageApp(config), registry=CollectorRegistry())
            await srv.start()
            return srv, StorageClient(srv.target)

        server, client = loop.run(start())
        app = server.app
        assert isinstance(app, StorageApp)
        return _measure(args, shape, per_request, loop, app, client, engine_path, engine_mem)
    finally:
        if client is not None:
            loop.run(client.close())
        if server is not None:
            loop.run(server.stop(1.0))
        loop.close()


def _measure(
    args: argparse.Namespace,
    shape: _Shape,
    per_request: int,
    loop: LoopThread,
    app: StorageApp,
    client: StorageClient,
    engine_path: str,
    engine_mem: np.ndarray[Any, Any],
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
    before = faults()
    start = time.perf_counter()
    loop.run(store_round())
    cold_s = time.perf_counter() - start
    cold_faults = faults() - before
    cold_phases = timers.take()

    # Then pre-fault the whole pool: no timed round may pay for fresh L1 pages.
    pool = manager.pool
    grow_start = time.perf_counter()
    pool.grow_for([pool.segment_bytes] * (pool.capacity_bytes // pool.segment_bytes))
    grow_s = time.perf_counter() - grow_start

    # Warm-up (not timed): the kernels' helper pool, index caches, the gRPC channel.
    _check_retrieve(loop, client, engine_id, shape, hashes[0], per_chunk_ids[0], engine_mem)
    loop.run(retrieve_round())
    memcpy_round()
    timers.take()

    times: dict[str, list[float]] = {
        k: [] for k in ("memcpy", "store", "retrieve", "gather", "scatter")
    }
    phases: dict[str, list[dict[str, float]]] = {"store": [], "retrieve": []}
    fault_counts: dict[str, list[int]] = {"store": [], "retrieve": []}
    for _ in range(args.repetitions):
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
        "lmcache_0_5_6": LMCACHE_REFERENCE,
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
    shape: _Shape,
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


def format_table(result: dict[str, Any]) -> str:
    """The figures as a readable table."""
    p = result["parameters"]
    lines = [
        f"datapath: {result['chunks']} chunks x {result['chunk_bytes'] / _MIB:.0f} MiB "
        f"({p['chunk_tokens']} tokens x {p['num_layers']} layers x {p['kv_heads']} heads x "
        f"{p['head_dim']} x {p['dtype']}, {p['layout']}, block {p['block_size']}), "
        f"{result['repetitions']} repetitions, {p['chunks_per_request']} chunks/request, "
        f"{p['copy_threads']} copy threads",
        "",
        f"{'':10} {'median GB/s':>12} {'best GB/s':>10} {'vs memcpy':>10} {'best vs':>8}",
        f"{'memcpy':10} {result['memcpy_gbps']:>12.2f} {result['best_memcpy_gbps']:>10.2f}",
    ]
    for op in ("store", "retrieve"):
        lines.append(
            f"{op:10} {result[f'{op}_gbps']:>12.2f} {result[f'best_{op}_gbps']:>10.2f} "
            f"{result[f'{op}_ratio']:>10.3f} {result[f'best_{op}_ratio']:>8.3f}"
        )
    lines.append(f"{'cold store':10} {result['cold_store_gbps']:>12.2f}  (first round, see below)")
    lines += [
        f"{'gather*':10} {result['kernel_gather_gbps']:>12.2f}",
        f"{'scatter*':10} {result['kernel_scatter_gbps']:>12.2f}",
        "  * the copy kernels called directly, without gRPC or L1 bookkeeping",
        f"target: >= {result['target_ratio']:.0%} of memcpy; LMCache 0.5.6: store "
        f"{LMCACHE_REFERENCE['store_gbps']} GB/s, retrieve {LMCACHE_REFERENCE['retrieve_gbps']}",
        "",
        "where one round goes (ms, median round):",
    ]
    for op in ("store", "retrieve"):
        parts = ", ".join(f"{k} {v}" for k, v in result["breakdown_ms"][op].items())
        faults = result["minor_faults_per_round"][op]
        lines.append(f"  {op}: {parts}; minor faults {faults}")
    parts = ", ".join(f"{k} {v}" for k, v in result["cold_store_breakdown_ms"].items())
    faults = result["minor_faults_per_round"]["cold_store"]
    lines.append(f"  cold store: {parts}; minor faults {faults}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.bench.datapath [--json]``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_table(result))


if __name__ == "__main__":
    main()
