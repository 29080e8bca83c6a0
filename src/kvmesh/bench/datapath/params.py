"""What ``kvmesh bench datapath`` measures: its options, chunk shape and target."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvmesh.common.dtypes import BY_SHORT

#: Target (docs/benchmarks.md, "Targets"): store and retrieve at this fraction of
#: the same run's memcpy.
TARGET_RATIO = 0.85

MIB = 1 << 20


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
    parser.add_argument(
        "--chunk-tokens", type=int, default=256, help="tokens per chunk (default: 256)"
    )
    parser.add_argument(
        "--num-layers", type=int, default=32, help="model layers per chunk (default: 32)"
    )
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer (default: 8)")
    parser.add_argument(
        "--head-dim", type=int, default=128, help="elements per head (default: 128)"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per paged-KV block of the engine (default: 16)",
    )
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default="bf16",
        help="element type of the KV cache (default: bf16)",
    )
    parser.add_argument(
        "--copy-threads",
        type=int,
        default=0,
        help="threads one copy may use (0 = the kernels' default: torch's thread count)",
    )
    parser.add_argument(
        "--store-copy-threads",
        type=int,
        default=1,
        help="threads one store's copy may use, the node's store_copy_threads (1 as a node "
        "runs them; 0 = as many as a load's copy)",
    )
    parser.add_argument(
        "--shm-dir", default="/dev/shm", help="where the engine file and L1 segments live"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the chunks' block order and hashes (default: 0)",
    )


@dataclass(frozen=True)
class Shape:
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
