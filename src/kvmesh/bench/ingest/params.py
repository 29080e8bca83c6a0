"""What ``kvmesh bench ingest`` measures: its options, workload names and targets."""

from __future__ import annotations

import argparse

from kvmesh.storage.events.config import DEFAULT_MAX_IN_FLIGHT_BATCHES

MODEL = "meta-llama/Llama-3.1-8B"
SALT = "tenant-a"

START_TIMEOUT_S = 60.0

#: docs/benchmarks.md, "Targets".
TARGETS = {"entries_per_s": 200_000, "ack_p99_ms": 5.0, "max_stall_ms": 50.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmesh bench ingest``."""
    parser.add_argument("--emitters", type=int, default=4, help="emitter processes (streams)")
    parser.add_argument("--batch-entries", type=int, default=64, help="entries per STORE batch")
    parser.add_argument(
        "--keys", type=int, default=1_000_000, help="keys ingested in all (split over emitters)"
    )
    parser.add_argument(
        "--window",
        type=int,
        nargs="+",
        default=[DEFAULT_MAX_IN_FLIGHT_BATCHES, 1],
        help="batches in flight (sent, not acked) per emitter; 1 is LMCache's synchronous flush,"
        f" {DEFAULT_MAX_IN_FLIGHT_BATCHES} the storage node's window. Several values: one run"
        " each",
    )
    parser.add_argument(
        "--group",
        type=int,
        default=0,
        help="batches per StreamEvents message at most when the window lets out several"
        " (0: the window; 1: never group)",
    )
    parser.add_argument(
        "--l1-share",
        type=int,
        default=4,
        help="every n-th batch reports L1 (dram), the others L2 (fs); 0: L2 only",
    )
    parser.add_argument(
        "--tokens", action="store_true", help="stamp 256 token ids on every entry (bigger batches)"
    )
    parser.add_argument("--lookups", type=int, default=2000, help="16-key lookups timed")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the generated keys and the timed lookups (default: 0)",
    )
    parser.add_argument(
        "--coordinator-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the coordinator process (repeatable)",
    )
