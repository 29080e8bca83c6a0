"""A whole load (or store) into vLLM's CPU KV layouts, from memory not in the CPU's cache.

:mod:`kvmesh.bench.kernels` times one 32 MiB chunk that stays in the CPU's
caches between rounds. A retrieve in serving is different: it moves one
document's chunks, written minutes earlier, into blocks spread over vLLM's
cache, so every line comes from memory. This benchmark times exactly that, per
model shape and vLLM CPU layout (``VLLM_CPU`` and ``VLLM_CPU_AMX``):

- ``scatter``: :func:`kvmesh.kernels.scatter_chunks` of one document's chunks
  (each round another document of a pool several times larger than the
  caches) into random distinct blocks;
- ``gather``: the same blocks back into chunk objects (a store);
- ``memcpy``: ``np.copyto`` of the same bytes between two other regions of
  pools of the same size, also cold: the copy limit of this run.

Each figure is the median round; rounds alternate the three so machine noise
hits them alike. The shapes: the tiny test model (4 layers, 2 KV heads, head
dim 64: one 6 144-token document is 24 chunks, 12 MiB in bf16) and
SmolLM2-135M (30 layers, 3 KV heads, head dim 64: 2 048 tokens are 8 chunks,
45 MiB), blocks of 128 tokens, chunks of 256.

Run ``python -m kvmesh.bench.kernels_load`` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvmesh.bench.kernels import median_gbps
from kvmesh.kernels import (
    KVLayoutKind,
    PagedKVCache,
    gather_chunks,
    native,
    paged_layer_shape,
    scatter_chunks,
)
from kvmesh.kernels.parallel import set_copy_threads

#: name: (layers, kv heads, head dim, chunks of one load)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (4, 2, 64, 24),
    "smollm2": (30, 3, 64, 8),
}
CHUNK_TOKENS = 256
BLOCK_SIZE = 128
#: Bytes of each pool (chunks, cache, memcpy source and destination): several
#: times any CPU cache here, so a round's bytes are not in the cache from an
#: earlier round.
POOL_BYTES = 384 << 20


def bench_shape(
    name: str,
    kind: KVLayoutKind,
    threads: int,
    rounds: int,
    *,
    pool_bytes: int = POOL_BYTES,
    seed: int = 0,
) -> dict[str, Any]:
    """One shape and layout at one copy-thread count (``pool_bytes``: see :data:`POOL_BYTES`)."""
    num_layers, kv_heads, head_dim, chunks = SHAPES[name]
    dtype = torch.bfloat16
    rng = random.Random(seed)
    block_bytes = 2 * kv_heads * BLOCK_SIZE * head_dim * 2
    num_blocks = max(pool_bytes // (block_bytes * num_layers), 4 * chunks * 2)
    shape = paged_layer_shape(kind, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    layers = [torch.ones(shape, dtype=dtype) for _ in range(num_layers)]
    kv = PagedKVCache(layers, kind)
    chunk_shape = kv.chunk_shape(CHUNK_TOKENS)
    load_bytes = chunks * int(np.prod(chunk_shape)) * 2
    documents = max(pool_bytes // load_bytes, 4)
    pool = torch.ones((documents, chunks, *chunk_shape), dtype=dtype)
    src = np.ones(documents * load_bytes, dtype=np.uint8)
    dst = np.ones(documents * load_bytes, dtype=np.uint8)
    per_chunk = CHUNK_TOKENS // BLOCK_SIZE
    times: dict[str, list[float]] = {"scatter": [], "gather": [], "memcpy": []}
    set_copy_threads(threads)
    try:
        for r in range(rounds + 1):  # round 0 warms the code paths and is not counted
            doc = (r * 7) % documents
            blocks = rng.sample(range(num_blocks), chunks * per_chunk)
            block_ids = [blocks[i * per_chunk : (i + 1) * per_chunk] for i in range(chunks)]
            srcs = list(pool[doc].unbind(0))
            outs = list(pool[(doc + documents // 2) % documents].unbind(0))
            a = src[doc * load_bytes : (doc + 1) * load_bytes]
            other = (doc + documents // 3) % documents
            b = dst[other * load_bytes : (other + 1) * load_bytes]
            for step, seconds in times.items():
                start = time.perf_counter()
                if step == "scatter":
                    scatter_chunks(kv, block_ids, srcs)
                elif step == "gather":
                    gather_chunks(kv, block_ids, outs)
                else:
                    np.copyto(b, a)
                if r:
                    seconds.append(time.perf_counter() - start)
    finally:
        set_copy_threads(None)
    memcpy = median_gbps(load_bytes, times["memcpy"])
    scatter = median_gbps(load_bytes, times["scatter"])
    gather = median_gbps(load_bytes, times["gather"])
    return {
        "shape": name,
        "layout": kind.name,
        "threads": threads,
        "load_mib": round(load_bytes / 2**20, 1),
        "scatter_ms": round(statistics.median(times["scatter"]) * 1e3, 3),
        "gather_ms": round(statistics.median(times["gather"]) * 1e3, 3),
        "memcpy_ms": round(statistics.median(times["memcpy"]) * 1e3, 3),
        "scatter_gbps": scatter,
        "gather_gbps": gather,
        "memcpy_gbps": memcpy,
        "scatter_vs_memcpy": round(scatter / memcpy, 3),
        "gather_vs_memcpy": round(gather / memcpy, 3),
    }


def run(rounds: int, threads: list[int], shapes: list[str]) -> dict[str, Any]:
    """Every shape, both vLLM CPU layouts, every thread count."""
    results = [
        bench_shape(name, kind, n, rounds)
        for name in shapes
        for kind in (KVLayoutKind.VLLM_CPU, KVLayoutKind.VLLM_CPU_AMX)
        for n in threads
    ]
    return {"native_kernel": native.status(), "rounds": rounds, "results": results}


def main() -> None:
    """Print the benchmark as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    print(json.dumps(run(args.rounds, args.threads, args.shapes), indent=2))


if __name__ == "__main__":
    main()
