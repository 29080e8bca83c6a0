"""Knobs of the coordinator core (docs/coordinator.md, "Settings").

The service's config (flags, ``KVMESH_*`` environment, YAML) maps onto this
frozen dataclass; it validates itself on construction and raises
InvalidArgument naming the bad field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kvmesh.common.errors import InvalidArgument

from .directory import DEFAULT_TOKEN_BINDING_CAP
from .eviction import (
    DEFAULT_EVICTION_RATIO,
    DEFAULT_MAX_VICTIMS_PER_CYCLE,
    DEFAULT_TRIGGER_WATERMARK,
    MAX_DELETE_BATCH,
)


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """Core settings with LMCache's defaults where LMCache has one.

    ``heartbeat_interval`` is the period nodes heartbeat at; eviction stays
    off for that long after start or restore (the readiness gate).
    ``checkpoint_path``/``metadata_path`` empty disable persistence (nothing
    is written). ``checkpoint_interval`` 0 writes only on a clean stop;
    ``health_check_interval`` / ``eviction_check_interval`` 0 disable those
    loops. ``token_binding_cap`` 0 disables token bindings.
    ``fence_sweep_interval`` is how often the background sweep of large
    fences runs (0: only ingested batches drive it). ``resync_min_interval``
    is the least time between two resyncs of one node for gaps inside an
    incarnation; ``resync_retry_interval`` how often resyncs still owed are
    sent (0: never; see :mod:`.resync`).
    """

    instance_timeout: float = 30.0
    health_check_interval: float = 10.0
    heartbeat_interval: float = 5.0
    eviction_check_interval: float = 5.0
    eviction_ratio: float = DEFAULT_EVICTION_RATIO
    trigger_watermark: float = DEFAULT_TRIGGER_WATERMARK
    max_delete_batch: int = MAX_DELETE_BATCH
    max_victims_per_cycle: int = DEFAULT_MAX_VICTIMS_PER_CYCLE
    redispatch_after: float = 30.0
    chunk_size: int = 256
    token_binding_cap: int = DEFAULT_TOKEN_BINDING_CAP
    checkpoint_path: str = ""
    checkpoint_interval: float = 60.0
    metadata_path: str = ""
    quiesce_timeout: float = 5.0
    fence_sweep_interval: float = 0.05
    resync_min_interval: float = 30.0
    resync_retry_interval: float = 1.0
    #: Weights of a matched token for engine scores: engine, local L1, peer L1, L2.
    score_weights: tuple[float, float, float, float] = (1.0, 0.8, 0.6, 0.4)
    #: Index the nodes' CacheBlend segments for BlendLookup (off, as in LMCache).
    enable_blend_lookup: bool = False
    #: Probe stride of a BlendLookup that names none.
    blend_probe_stride: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidArgument(f"{f.name} must be finite", field=f.name)
        _check(self.instance_timeout > 0, "instance_timeout", "must be > 0")
        _check(self.health_check_interval >= 0, "health_check_interval", "must be >= 0")
        _check(self.heartbeat_interval > 0, "heartbeat_interval", "must be > 0")
        _check(self.eviction_check_interval >= 0, "eviction_check_interval", "must be >= 0")
        _check(0.0 <= self.eviction_ratio <= 1.0, "eviction_ratio", "must be in [0, 1]")
        _check(0.0 < self.trigger_watermark <= 1.0, "trigger_watermark", "must be in (0, 1]")
        _check(
            1 <= self.max_delete_batch <= MAX_DELETE_BATCH,
            "max_delete_batch",
            f"must be in [1, {MAX_DELETE_BATCH}]",
        )
        _check(self.max_victims_per_cycle >= 1, "max_victims_per_cycle", "must be >= 1")
        _check(self.redispatch_after >= 0, "redispatch_after", "must be >= 0")
        _check(self.chunk_size >= 1, "chunk_size", "must be >= 1")
        _check(self.blend_probe_stride >= 1, "blend_probe_stride", "must be >= 1")
        _check(self.token_binding_cap >= 0, "token_binding_cap", "must be >= 0")
        _check(self.checkpoint_interval >= 0, "checkpoint_interval", "must be >= 0")
        _check(self.quiesce_timeout > 0, "quiesce_timeout", "must be > 0")
        _check(self.fence_sweep_interval >= 0, "fence_sweep_interval", "must be >= 0")
        _check(self.resync_min_interval >= 0, "resync_min_interval", "must be >= 0")
        _check(self.resync_retry_interval >= 0, "resync_retry_interval", "must be >= 0")
        _check(
            len(self.score_weights) == 4
            and all(math.isfinite(w) and w >= 0 for w in self.score_weights),
            "score_weights",
            "must be four finite numbers >= 0",
        )


def _check(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise InvalidArgument(f"{name} {rule}", field=name)
