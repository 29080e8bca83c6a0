"""What ``kvmesh bench lookup`` measures: its options, parameters and target."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: The target (docs/benchmarks.md, "Targets").
TARGET_LOOKUP_P50_MS = 0.5

ARRANGEMENTS = ("node-lane", "node", "processes-lane", "processes", "in-process")
MODEL = "bench/model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmesh bench lookup`` (the CLI adds ``--json``)."""
    parser.add_argument("--chunks", type=int, default=32, help="chunks of the stored prompt")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="the gateway's chunk size")
    parser.add_argument("--iterations", type=int, default=2000, help="timed calls per figure")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls first")
    parser.add_argument(
        "--arrangement",
        choices=[*ARRANGEMENTS, "all"],
        default="all",
        help="one 'kvmesh node' process dialled on its local lane or on gRPC, storage and "
        "gateway in their own processes (as deployed apart), both in a thread of this "
        "process, or all; the headline figures come from the first one that runs",
    )
    parser.add_argument(
        "--storage-transport",
        choices=["tcp", "unix"],
        default="tcp",
        help="how the gateway reaches its storage node: loopback TCP or a unix socket",
    )
    parser.add_argument(
        "--hash-memo-entries",
        type=int,
        default=8192,
        help="the gateway's memo of recent prefix hashes (its default; 0 hashes every "
        "lookup's 32 chunks with blake3 afresh)",
    )
    parser.add_argument(
        "--num-layers", type=int, default=2, help="model layers per chunk (default: 2)"
    )
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads per layer (default: 2)")
    parser.add_argument("--head-dim", type=int, default=16, help="elements per head (default: 16)")
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per paged-KV block of the engine (default: 16)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="afterwards, a separate cProfile pass; adds the top functions of client and servers",
    )
    parser.add_argument("--profile-top", type=int, default=12, help="functions per profile")
    parser.add_argument("--shm-dir", default="/dev/shm", help="engine file and L1 segments")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the stored prompt's tokens and KV contents (default: 0)",
    )


@dataclass(frozen=True)
class Params:
    chunks: int
    chunk_tokens: int
    iterations: int
    warmup: int
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    seed: int
    storage_transport: str = "tcp"
    hash_memo_entries: int = 8192

    @property
    def tokens(self) -> int:
        return self.chunks * self.chunk_tokens

    @property
    def num_blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_size * self.kv_heads * self.head_dim * 2

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.num_layers * self.chunk_tokens * self.kv_heads * self.head_dim * 2


@dataclass
class Endpoints:
    """Where the servers of one arrangement listen."""

    gateway: str
    gateway_metrics: str
    storage_metrics: str
    # Server processes running under cProfile (toggled around the timed loop).
    profiled_pids: list[int]
