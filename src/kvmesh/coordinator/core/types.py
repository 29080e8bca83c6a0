"""Plain value types the coordinator core returns to its servicer.

Every read API of the core answers with these frozen, slotted records (or
tuples of them) so the servicer converts them to protobuf field by field and
nothing mutable leaks out of a lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey


class Placement(NamedTuple):
    """One copy of a key: where it lives and who reported it last.

    For a private placement ``instance_id`` is the owner; for a shared one
    (a pool several instances mount) it is the last instance that reported
    it, and ``incarnation`` is that reporter's incarnation at report time.
    """

    instance_id: str
    incarnation: int
    tier: Tier
    backend: str
    size_bytes: int
    shared: bool


class KeyInfo(NamedTuple):
    """What the directory knows about one key.

    ``placements`` is sorted by ``(instance_id, tier, backend)``; empty when
    the key is unknown. ``token_ids`` is filled by lookups only (listings give
    ``num_tokens``); both are empty/0 when the chunk's tokens are unknown or
    the binding was dropped under the binding cap. ``last_access`` is the
    newest emitter timestamp of a store or access (0.0 = never).
    """

    key: ObjectKey
    placements: tuple[Placement, ...]
    access_count: int = 0
    last_access: float = 0.0
    num_tokens: int = 0
    token_ids: tuple[int, ...] = ()


class TokenLookup(NamedTuple):
    """Answer of a token-form lookup.

    ``chunks`` complete chunks were hashed; ``results`` has one entry per key
    (chunk-major, then rank, then object group). ``cached_prefix_chunks`` is
    the number of leading chunks for which every kv rank has at least one
    placement (in any object group).
    """

    chunks: int
    results: tuple[KeyInfo, ...]
    cached_prefix_chunks: int = 0


class KeyPage(NamedTuple):
    """One page of a directory listing.

    ``next_page_token`` is empty on the last page. A page may hold fewer than
    ``limit`` entries while more remain (each call examines a bounded number
    of keys so it never holds the directory lock for long); keep calling
    until the token is empty. ``total`` is the number of keys in the whole
    directory when no filter was given, else None (counting filtered keys
    would need a full scan).
    """

    entries: tuple[KeyInfo, ...]
    next_page_token: str
    total: int | None


@dataclass(frozen=True, slots=True)
class TierTotals:
    """Placement count and bytes of one tier."""

    count: int = 0
    size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class DirectoryStats:
    """Directory totals, computed without walking the keys.

    ``l1_keys_by_instance`` counts each instance's L1 reverse-index entries;
    an instance that reported anything appears, with 0 if it holds no L1.
    ``fence_backlog_keys`` counts keys of large fences not yet swept (their
    fenced placements are already invisible and un-counted; they may still
    be in ``num_keys``).
    """

    num_keys: int
    num_placements: int
    l1: TierTotals
    l2: TierTotals
    l1_keys_by_instance: Mapping[str, int]
    token_bindings: int
    token_binding_cap: int
    fence_backlog_keys: int = 0


@dataclass(frozen=True, slots=True)
class CursorInfo:
    """The gate's cursor of one emitter plus its admission counters.

    The counters live as long as the emitter's entry in the gate (they
    survive incarnation changes and are reset by ``drop_instance``).
    ``last_admit_time`` is the coordinator's wall clock at the last admitted
    batch (0.0 = none yet).
    """

    instance_id: str
    incarnation: int
    last_seq: int
    gap_detected: bool
    batches_admitted: int
    batches_duplicate: int
    batches_stale: int
    incarnation_changes: int
    last_admit_time: float


@dataclass(frozen=True, slots=True)
class IngestSummary:
    """Outcome counts of a list of batches."""

    applied: int = 0
    duplicates: int = 0
    stale: int = 0


@dataclass(frozen=True, slots=True)
class ConsumerStats:
    """Per-consumer delivery counters kept by the broadcaster."""

    name: str
    batches_delivered: int
    consume_failures: int
    fence_failures: int
    apply_seconds: float


@dataclass(frozen=True, slots=True)
class ModuleCapacity:
    """Declared capacity of one compartment ``(tier, backend, shared)``; 0 = undeclared."""

    tier: Tier
    backend: str
    capacity_bytes: int
    shared: bool = False


@dataclass(frozen=True, slots=True)
class ModuleMemoryStatus:
    """Used vs declared bytes of one compartment; ratio None when capacity is 0."""

    tier: Tier
    backend: str
    shared: bool
    used_bytes: int
    capacity_bytes: int
    usage_ratio: float | None


@dataclass(frozen=True, slots=True)
class InstanceMemoryStatus:
    """Memory view of one instance: its private compartments, sorted by (tier, backend)."""

    instance_id: str
    registered: bool
    declared_capacity: bool
    modules: tuple[ModuleMemoryStatus, ...]


@dataclass(frozen=True, slots=True)
class FleetMemoryStatus:
    """Every instance worth listing plus the shared pools, each listed once."""

    instances: tuple[InstanceMemoryStatus, ...]
    shared_modules: tuple[ModuleMemoryStatus, ...]


class Endpoints(NamedTuple):
    """Where a node's services listen (for operators and, later, peer fetches)."""

    gateway_address: str = ""
    storage_address: str = ""
    metrics_address: str = ""


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """A registered storage node.

    ``registration_time`` is wall-clock seconds (for display);
    ``last_heartbeat`` is on the registry's monotonic clock and
    ``heartbeat_age_seconds`` is filled in when the entry is read.
    """

    instance_id: str
    incarnation: int
    endpoints: Endpoints
    metadata: Mapping[str, str]
    registration_time: float
    last_heartbeat: float
    heartbeat_age_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Registration:
    """Result of a register call."""

    instance_id: str
    re_registered: bool


@dataclass(frozen=True, slots=True)
class QuotaStatus:
    """Quota and usage of one salt on one tier (quotas exist on L2 only)."""

    cache_salt: str
    tier: Tier
    limit_bytes: int | None
    quota_exists: bool
    used_bytes: int


@dataclass(frozen=True, slots=True)
class QuotaListing:
    """Usage total of a tier plus one status per salt with usage or (L2) a quota."""

    tier: Tier
    total_bytes: int
    by_cache_salt: tuple[QuotaStatus, ...]


@dataclass(frozen=True, slots=True)
class PinEntry:
    """One pinned chunk key (``object_group_id`` is always 0) and its pin count."""

    key: ObjectKey
    pin_count: int


@dataclass(frozen=True, slots=True)
class PinPage:
    """A page of pins in first-pinned order; ``next_page_token`` empty on the last page."""

    total: int
    pins: tuple[PinEntry, ...]
    next_page_token: str = ""


@dataclass(frozen=True, slots=True)
class PinResult:
    """Chunks resolved from tokens and keys affected by a pin or unpin."""

    requested_chunks: int
    affected_keys: int


@dataclass(frozen=True, slots=True)
class DeleteRequest:
    """One delete sent to one instance: at most ``max_delete_batch`` keys.

    ``command_id`` is the id of the command that carried it ("" when it was
    not accepted, or the dispatcher names no commands).
    """

    instance_id: str
    tier: Tier
    backend: str
    keys: tuple[ObjectKey, ...]
    accepted: bool
    command_id: str = ""


@dataclass(frozen=True, slots=True)
class EvictionReport:
    """What one eviction cycle decided and sent.

    ``ready`` is False while the readiness gate holds (nothing is planned or
    sent). ``plan`` maps each salt over its quota to its victims (pinned keys
    excluded), including victims still in flight from an earlier cycle;
    ``plan_bytes`` is their L2 bytes per salt. A dry run plans, sends nothing.
    ``undeliverable`` counts victims no live instance holds; they stay in the
    LRU and are retried later.
    """

    ready: bool
    plan: Mapping[str, tuple[ObjectKey, ...]] = field(default_factory=dict)
    plan_bytes: Mapping[str, int] = field(default_factory=dict)
    requests: tuple[DeleteRequest, ...] = ()
    keys_in_flight: int = 0
    undeliverable: int = 0
    dry_run: bool = False


@dataclass(frozen=True, slots=True)
class DeleteKeysResult:
    """Outcome of an operator delete: keys asked for, keys sent, pinned keys left alone."""

    requested_keys: int
    dispatched_keys: int
    pin_skipped: int
    requests: tuple[DeleteRequest, ...] = ()


@dataclass(frozen=True, slots=True)
class CheckpointResult:
    """What one checkpoint write did (``error`` empty when ``ok``)."""

    ok: bool
    path: str
    size_bytes: int = 0
    sections: tuple[str, ...] = ()
    duration_seconds: float = 0.0
    error: str = ""
