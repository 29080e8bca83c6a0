"""Run ``kvmesh bench datapath``: the engine file, a storage node, then the timed rounds.

The node listens on a loopback port of this process; every file is removed,
also on failure.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from kvmesh import kernels
from kvmesh.bench.common import LoopThread, Progress, size_text
from kvmesh.common.config import ConfigError
from kvmesh.rpc.server import Server, create_server
from kvmesh.storage.app import StorageApp
from kvmesh.storage.client import StorageClient
from kvmesh.storage.config import StorageConfig

from .measure import measure
from .params import MIB, Shape


@contextmanager
def _engine_file(directory: str, shape: Shape) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
    """The engine's KV cache file, every page written (so faulted in), removed at exit."""
    path = os.path.join(directory, f"engine-{uuid.uuid4().hex[:8]}-kv")
    total = shape.layer_bytes * shape.num_layers
    try:
        with open(path, "wb") as f:
            f.truncate(total)
        mem = np.memmap(path, dtype=np.uint64, mode="r+", shape=(total // 8,))
        # Distinct values everywhere: a copy that moved the wrong block shows up. In
        # 32 MiB steps, so filling never holds a second copy of the whole cache.
        step = 4 * MIB
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the figures and the parameters (JSON-serializable)."""
    shape = Shape(
        chunks=args.chunks,
        chunk_tokens=args.chunk_tokens,
        num_layers=args.num_layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=args.dtype,
    )
    if shape.chunks < 1 or args.repetitions < 1:
        raise ConfigError("--chunks and --repetitions must be >= 1")
    if args.store_copy_threads < 0:
        raise ConfigError("--store-copy-threads must be >= 0")
    if shape.chunk_tokens % shape.block_size:
        raise ConfigError("--chunk-tokens must be a multiple of --block-size")
    per_request = args.chunks_per_request or shape.chunks
    with Progress.for_args("datapath", args) as progress:
        progress.say(
            f"{shape.chunks} chunks x {size_text(shape.chunk_bytes)}, "
            f"{args.repetitions} repetitions"
        )
        if args.copy_threads:
            kernels.set_copy_threads(args.copy_threads)
        work_dir = tempfile.mkdtemp(prefix="kvmesh-bench-datapath-", dir=args.shm_dir)
        data_dir = tempfile.mkdtemp(prefix="kvmesh-bench-datapath-")
        try:
            engine_bytes = shape.layer_bytes * shape.num_layers
            progress.phase(f"writing the engine's KV cache file ({size_text(engine_bytes)})")
            with _engine_file(work_dir, shape) as (engine_path, engine_mem):
                return _run(
                    args, shape, per_request, work_dir, data_dir, engine_path, engine_mem, progress
                )
        finally:
            if args.copy_threads:
                kernels.set_copy_threads(None)
            shutil.rmtree(work_dir, ignore_errors=True)
            shutil.rmtree(data_dir, ignore_errors=True)


def _run(
    args: argparse.Namespace,
    shape: Shape,
    per_request: int,
    work_dir: str,
    data_dir: str,
    engine_path: str,
    engine_mem: np.ndarray[Any, Any],
    progress: Progress,
) -> dict[str, Any]:
    # L1 = every chunk plus one segment, so a full round never reaches the eviction
    # watermark (eviction would turn a store into a measurement of the evictor).
    segment = max(4 * shape.chunk_bytes, 64 * MIB)
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
        store_copy_threads=args.store_copy_threads,
        log_level="WARNING",
    )
    progress.phase(f"starting a storage node (L1 {size_text(l1_bytes)})")
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
        return measure(
            args, shape, per_request, loop, app, client, engine_path, engine_mem, progress
        )
    finally:
        if client is not None:
            loop.run(client.close())
        if server is not None:
            loop.run(server.stop(1.0))
        loop.close()
