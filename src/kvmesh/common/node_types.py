"""Answers a storage node gives about its data path, shared by the node and its gateway.

The gateway core talks to storage through its NodeStorage protocol, over
gRPC or in-process (``kvmesh node``); both links and the storage node use
these plain types, mirroring ``kvmesh.storage.v1`` (enum values are the
proto numbers).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StoreOutcome(enum.IntEnum):
    """What storage did with one chunk of a store (``kvmesh.storage.v1.StoreOutcome``)."""

    STORED = 1
    ALREADY_CACHED = 2
    NO_MEMORY = 3


@dataclass(frozen=True, slots=True)
class PrefetchState:
    """A lookup-and-lock as storage reports it (hits are chunks, model-wide)."""

    prefetch_id: str
    completed: bool
    hit_chunks: int = 0
    l1_hit_chunks: int = 0
    l2_hit_chunks: int = 0
    #: The TTL of the lease the locks became (0: not leased, or not completed).
    lease_ttl_ms: int = 0


@dataclass(frozen=True, slots=True)
class Slot:
    """Where an engine copies one chunk to or from (engine-driven path)."""

    chunk_index: int
    path: str
    offset_bytes: int
    size_bytes: int
