"""Tunables of the storage core (:class:`StorageOptions`); the service config maps onto these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvmesh.storage.core.controllers.l2tier import DEFAULT_BACKOFF_S, DEFAULT_MAX_BACKOFF_S
from kvmesh.storage.core.controllers.prefetch import DEFAULT_MAX_IN_FLIGHT
from kvmesh.storage.core.controllers.prefetch_types import PrefetchPolicy
from kvmesh.storage.core.controllers.store import (
    DEFAULT_BATCH_KEYS,
    DEFAULT_MAX_PENDING_KEYS,
    StorePolicy,
)
from kvmesh.storage.core.eviction import (
    DEFAULT_PERIOD_S,
    DEFAULT_TARGET_WATERMARK,
    DEFAULT_TRIGGER_WATERMARK,
    L2EvictionConfig,
    Quota,
)
from kvmesh.storage.core.l1.manager import DEFAULT_READ_TTL_S, DEFAULT_WRITE_TTL_S
from kvmesh.storage.core.l1.pool import DEFAULT_SEGMENT_BYTES, DEFAULT_SHM_DIR


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """Tunables of the storage core; the service config maps onto these."""

    # L1 pool
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    shm_dir: str = DEFAULT_SHM_DIR
    initial_l1_bytes: int | None = None  # None: one segment at start
    grow_watermark: float = 0.75
    prefault: bool = True
    full_chunk_bytes: int | None = None  # None: learned (largest object size seen)
    # L1 locks
    read_ttl_s: float = DEFAULT_READ_TTL_S
    write_ttl_s: float = DEFAULT_WRITE_TTL_S
    # eviction
    eviction_period_s: float = DEFAULT_PERIOD_S
    trigger_watermark: float = DEFAULT_TRIGGER_WATERMARK
    target_watermark: float = DEFAULT_TARGET_WATERMARK
    l2_eviction: Mapping[str, L2EvictionConfig] = field(default_factory=dict)
    default_quota: Quota | None = None  # None: salts without a quota are exempt
    # controllers
    store_policy: StorePolicy = StorePolicy.DEFAULT
    store_batch_keys: int = DEFAULT_BATCH_KEYS
    store_max_pending_keys: int = DEFAULT_MAX_PENDING_KEYS
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.DEFAULT
    prefetch_max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    l2_backoff_s: float = DEFAULT_BACKOFF_S
    l2_max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    # threads
    background_threads: bool = True  # eviction loops and ahead-of-need pool growth
    index_l2_at_start: bool = True
    close_flush_timeout_s: float = 5.0
    clear_drain_timeout_s: float = 20.0  # a Clear waits this long for owed L2 writes
