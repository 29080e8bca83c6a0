"""Benchmark of the gather/scatter kernels against a plain memcpy of the same bytes.

The target (docs/benchmarks.md, "Targets") asks store and retrieve to reach
85 % of a one-thread memcpy of the same bytes measured in the same run, for
32 MiB chunks (256 tokens × 32 layers × 8 kv heads × 128 head_dim × bf16,
block_size 16). This module times, per layout and per torch thread count:

- ``numpy_memcpy_gbps``: ``np.copyto`` of one 32 MiB buffer into another (one
  thread; glibc's memcpy, which switches to non-temporal stores at this size);
- ``torch_copy_gbps``: ``Tensor.copy_`` of the same bytes (uses the thread
  count; timed after the others, see ``bench_layout``);
- ``gather_gbps`` / ``scatter_gbps``: :func:`kvmesh.kernels.gather_chunks` /
  :func:`kvmesh.kernels.scatter_chunks` of one chunk with random, distinct block ids,
  with the CPU backend of the row: ``native`` (the non-temporal C kernel of
  :mod:`kvmesh.kernels.native`, the default), ``numpy`` (its fallback) or ``torch``.

``summary`` puts the native and NumPy paths beside memcpy for the headline
case (FLASH_ATTN over one anonymous storage) at each thread count.

All destinations are written once before timing (first touch of fresh pages
is 5–30× slower than a warm copy), memcpy, gather and scatter are
interleaved round by round so machine noise hits them alike, and each figure
is the median round (the best round is reported too).

Run ``python -m kvmesh.bench.kernels`` (prints JSON); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

import kvmesh.kernels.ops
from kvmesh.kernels import (
    KVLayoutKind,
    PagedKVCache,
    gather_chunks,
    native,
    paged_layer_shape,
    scatter_chunks,
)

logger = logging.getLogger(__name__)


@contextmanager
def _threads_and_backend(n: int, backend: str) -> Iterator[None]:
    """Run with ``n`` torch threads (the kernels' copy threads follow) and a CPU backend."""
    before = torch.get_num_threads()
    before_backend = kvmesh.kernels.ops._CPU_BACKEND
    if backend == "native" and native.load() is None:
        raise RuntimeError(f"native copy kernel unavailable: {native.status()}")
    torch.set_num_threads(n)
    kvmesh.kernels.ops._CPU_BACKEND = backend
    try:
        yield
    finally:
        torch.set_num_threads(before)
        kvmesh.kernels.ops._CPU_BACKEND = before_backend


@contextmanager
def _paged_memory(nbytes: int, backing: str) -> Iterator[torch.Tensor]:
    """``nbytes`` of pre-faulted memory: anonymous (torch) or a /dev/shm file mapping."""
    if backing == "anon":
        mem = torch.empty(nbytes, dtype=torch.uint8)
        mem.fill_(1)
        yield mem
        return
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvmesh-bench-", dir=shm_dir)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
        # Through NumPy so the mapping cannot close under live views (torch.frombuffer
        # drops the buffer export).
        mem = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
        mem.fill_(1)
        yield mem
        del mem
        try:
            mapping.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            logger.debug("bench mapping still referenced at exit")
    finally:
        os.close(fd)
        os.unlink(path)


def median_gbps(nbytes: int, seconds: list[float]) -> float:
    """GB/s (10⁹ bytes) of the median of ``seconds`` for ``nbytes``."""
    return round(nbytes / statistics.median(seconds) / 1e9, 2)


def bench_layout(
    kind: KVLayoutKind,
    *,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    num_tokens: int,
    num_blocks: int,
    dtype: torch.dtype,
    threads: int,
    rounds: int,
    fused: bool = True,
    backing: str = "anon",
    backend: str = "native",
    seed: int = 0,
) -> dict[str, Any]:
    """Time gather/scatter of one chunk for ``kind`` beside memcpy of the same bytes."""
    layer_shape = paged_layer_shape(kind, num_blocks, block_size, kv_heads, head_dim)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    layer_bytes = int(np.prod(layer_shape)) * itemsize
    with _paged_memory(layer_bytes * num_layers, backing) as mem:
        typed = mem.view(dtype)
        per_layer = layer_bytes // itemsize
        layers = [
            typed[i * per_layer : (i + 1) * per_layer].view(layer_shape) for i in range(num_layers)
        ]
        if not fused:
            # Separate allocations: the per-layer path of the kernels.
            layers = [layer.clone() for layer in layers]
        kv = PagedKVCache(layers, kind)
        gen = torch.Generator().manual_seed(seed)
        need = num_tokens // block_size
        block_ids = torch.randperm(num_blocks, generator=gen)[:need].tolist()
        chunk = torch.empty(kv.chunk_shape(num_tokens), dtype=dtype)
        chunk.fill_(0)
        nbytes = chunk.numel() * itemsize

        np_src = np.ones(nbytes, dtype=np.uint8)
        np_dst = np.zeros(nbytes, dtype=np.uint8)
        t_src = torch.ones(nbytes, dtype=torch.uint8)
        t_dst = torch.zeros(nbytes, dtype=torch.uint8)

        methods: dict[str, Callable[[], object]] = {
            "numpy_memcpy": lambda: np.copyto(np_dst, np_src),
            "gather": lambda: gather_chunks(kv, [block_ids], [chunk]),
            "scatter": lambda: scatter_chunks(kv, [block_ids], [chunk]),
        }
        times: dict[str, list[float]] = {name: [] for name in methods}
        with _threads_and_backend(threads, backend):
            for fn in methods.values():  # warm-up: caches, views, the helper pool
                fn()
            for _ in range(rounds):
                for name, fn in methods.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            # torch_copy is timed apart, after the others: with 2+ threads its
            # OpenMP workers keep spinning on the other cores for a while after
            # it returns, which halved whatever was timed next on a 2-core box.
            times["torch_copy"] = []
            t_dst.copy_(t_src)
            for _ in range(rounds):
                start = time.perf_counter()
                t_dst.copy_(t_src)
                times["torch_copy"].append(time.perf_counter() - start)
        memcpy = median_gbps(nbytes, times["numpy_memcpy"])
        gather = median_gbps(nbytes, times["gather"])
        scatter = median_gbps(nbytes, times["scatter"])
        best = {name: round(nbytes / min(t) / 1e9, 2) for name, t in times.items()}
        return {
            "layout": kind.name,
            "fused": kv.fused,
            "backing": backing,
            "cpu_backend": backend,
            "threads": threads,
            "chunk_shape": list(kv.chunk_shape(num_tokens)),
            "chunk_mib": round(nbytes / 2**20, 2),
            "numpy_memcpy_gbps": memcpy,
            "torch_copy_gbps": median_gbps(nbytes, times["torch_copy"]),
            "gather_gbps": gather,
            "scatter_gbps": scatter,
            "gather_vs_memcpy": round(gather / memcpy, 3),
            "scatter_vs_memcpy": round(scatter / memcpy, 3),
            # Best rounds: less sensitive to other processes on a shared 2-core box.
            "best_gbps": best,
            "best_gather_vs_memcpy": round(best["gather"] / best["numpy_memcpy"], 3),
            "best_scatter_vs_memcpy": round(best["scatter"] / best["numpy_memcpy"], 3),
        }


def run_kernel_bench(
    *,
    num_layers: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    num_tokens: int = 256,
    num_blocks: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    threads: tuple[int, ...] = (1, 2),
    rounds: int = 15,
) -> dict[str, Any]:
    """Run the kernel benchmark; returns the configuration and one result row per case.

    Cases, each at every thread count: with the native kernel (skipped, and
    said so in ``config``, when it cannot load) and with NumPy, every layout
    over one shared storage (the shared-memory case, one indexed call per
    chunk), FLASH_ATTN over separate per-layer tensors and FLASH_ATTN over a
    /dev/shm file mapping; then the torch-ops CPU backend for comparison. MLA
    has one plane, so it runs with twice the layers to move the same 32 MiB in
    the same 32 KiB block runs.
    """
    common: dict[str, Any] = {
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "num_tokens": num_tokens,
        "num_blocks": num_blocks,
        "dtype": dtype,
        "rounds": rounds,
    }
    have_native = native.load() is not None
    cases: list[tuple[KVLayoutKind, bool, str, str]] = [
        (kind, fused, backing, backend)
        for backend in (("native", "numpy") if have_native else ("numpy",))
        for kind, fused, backing in (
            (KVLayoutKind.FLASH_ATTN, True, "anon"),
            (KVLayoutKind.FLASHINFER, True, "anon"),
            (KVLayoutKind.MLA, True, "anon"),
            (KVLayoutKind.FLASH_ATTN, False, "anon"),
            (KVLayoutKind.FLASH_ATTN, True, "shm"),
        )
    ]
    # The alternative: torch index_select / index_put_ on torch's intra-op threads.
    cases += [
        (KVLayoutKind.FLASH_ATTN, True, "anon", "torch"),
        (KVLayoutKind.FLASH_ATTN, False, "anon", "torch"),
    ]
    results = []
    for kind, fused, backing, backend in cases:
        mla = kind is KVLayoutKind.MLA
        shape: dict[str, Any] = {
            **common,
            "num_layers": num_layers * 2 if mla else num_layers,
            "kv_heads": 1 if mla else kv_heads,
            "head_dim": kv_heads * head_dim if mla else head_dim,
        }
        for n in threads:
            results.append(
                bench_layout(
                    kind, threads=n, fused=fused, backing=backing, backend=backend, **shape
                )
            )
    return {
        "config": {
            **{k: str(v) for k, v in common.items()},
            "num_layers": num_layers,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "native_kernel": native.status(),
        },
        "summary": _summary(results),
        "results": results,
    }


def _summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Native and NumPy gather/scatter beside memcpy: FLASH_ATTN, one anonymous storage."""
    rows = []
    for row in results:
        if row["layout"] != "FLASH_ATTN" or not row["fused"] or row["backing"] != "anon":
            continue
        if row["cpu_backend"] not in ("native", "numpy"):
            continue
        rows.append(
            {
                key: row[key]
                for key in (
                    "cpu_backend",
                    "threads",
                    "numpy_memcpy_gbps",
                    "gather_gbps",
                    "scatter_gbps",
                    "gather_vs_memcpy",
                    "scatter_vs_memcpy",
                    "best_gather_vs_memcpy",
                    "best_scatter_vs_memcpy",
                )
            }
        )
    return rows


#: glibc switches memcpy to non-temporal stores only above ~19 MiB here, so the
#: kernels' 32 KiB block runs pay a read-for-ownership per destination line that
#: a 32 MiB memcpy does not. This tunable (read at process start) lowers the
#: switch to 32 KiB; ``--nt-threshold`` reruns the bench under it for comparison.
NT_THRESHOLD_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x8000"


def run_with_nt_threshold(rounds: int, threads: tuple[int, ...]) -> dict[str, Any]:
    """Rerun the benchmark in a child process whose glibc uses NT stores from 32 KiB."""
    env = {**os.environ, "GLIBC_TUNABLES": NT_THRESHOLD_TUNABLE}
    cmd = [sys.executable, "-m", "kvmesh.bench.kernels", "--rounds", str(rounds), "--threads"]
    cmd += [str(t) for t in threads]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main() -> None:
    """Print the benchmark as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--quick", action="store_true", help="small shapes, few rounds")
    parser.add_argument(
        "--nt-threshold",
        action="store_true",
        help=f"also run under GLIBC_TUNABLES={NT_THRESHOLD_TUNABLE} (a child process)",
    )
    args = parser.parse_args()
    if args.quick:
        figures = run_kernel_bench(num_layers=4, num_blocks=32, rounds=3, threads=(1,))
    else:
        figures = run_kernel_bench(rounds=args.rounds, threads=tuple(args.threads))
    if args.nt_threshold:
        figures["with_nt_threshold_32k"] = run_with_nt_threshold(args.rounds, tuple(args.threads))
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
