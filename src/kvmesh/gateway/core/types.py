"""Plain values the gateway core takes from and gives to its servicer, and its counters."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """An engine worker as it registers."""

    engine_id: str
    model_name: str
    world_size: int
    worker_id: int
    block_size: int


@dataclass(frozen=True, slots=True)
class PromptRangeSpec:
    """The token range of a request that an engine call is about."""

    request_id: str
    model_name: str
    world_size: int
    cache_salt: str
    token_ids: np.ndarray
    start_token: int
    end_token: int


@dataclass(frozen=True, slots=True)
class PrefetchStatus:
    """What Lookup / QueryPrefetchStatus return to the engine."""

    completed: bool
    hit_chunks: int = 0
    hit_tokens: int = 0
    l1_hit_chunks: int = 0
    l2_hit_chunks: int = 0
    #: The storage lease holding the hit's read locks ("" when none), and its TTL.
    lease_id: str = ""
    lease_ttl_ms: int = 0


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Counts of a store."""

    stored_chunks: int
    already_cached_chunks: int
    skipped_chunks: int


@dataclass
class GatewayStats:
    """Counters exported as ``kvmesh_gateway_*`` metrics (one instance, shared by the pieces)."""

    lookups: int = 0
    lookup_requested_tokens: int = 0
    lookup_hit_tokens: int = 0
    lookup_l1_hit_chunks: int = 0
    lookup_l2_hit_chunks: int = 0
    lookups_without_engine: int = 0
    stores: int = 0
    stored_chunks: int = 0
    store_skipped_chunks: int = 0
    retrieves: int = 0
    retrieved_chunks: int = 0
    retrieve_missed_chunks: int = 0
    #: Loads the scheduler started ahead; worker Retrieves that joined one; ahead calls
    #: that started nothing because the worker had asked already or one was running.
    retrieves_ahead: int = 0
    retrieves_joined: int = 0
    retrieves_ahead_refused: int = 0
    sessions_expired: int = 0
    prefetch_waits: int = 0
    prefetch_wait_seconds: float = 0.0
    locks_released: int = 0
    engines_reaped: int = 0
    #: Engine instances (schedulers) gone silent whose sessions and leases were ended.
    owners_reaped: int = 0
    #: Registrations of an engine the gateway had forgotten (restarted, or reaped it).
    reregistrations: int = 0
    block_allocations: int = 0
    #: CacheBlend segments: slots prepared for a store, found resident, asked for and absent.
    segment_stores: int = 0
    segment_hits: int = 0
    segment_misses: int = 0
