"""``kvmesh bench datapath``: store and retrieve throughput through a real storage service.

Target (docs/benchmarks.md, "Targets"): store (engine → L1) and retrieve (L1 →
engine) must reach 85 % of a one-thread memcpy of the same bytes measured in
the same run; LMCache 0.5.6 does 4.3–4.6 GB/s store and about 4.0 GB/s
retrieve on this machine kind.

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

Modules: :mod:`.params` (options, chunk shape, target), :mod:`.runner`
(``run``: the engine file and the node), :mod:`.measure` (the timed rounds)
and :mod:`.report` (``format_table``).
"""

from __future__ import annotations

from kvmesh.bench.common import bench_main

from .params import add_arguments
from .report import format_table
from .runner import run

__all__ = ["add_arguments", "format_table", "main", "run"]


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.bench.datapath [--json]``."""
    bench_main(__doc__, add_arguments, run, format_table, argv)
