"""The storage node's L2 controllers: write-through (store) and lookup/load (prefetch)."""

from kvmesh.storage.core.controllers.l2tier import L2Tier
from kvmesh.storage.core.controllers.prefetch import PrefetchController
from kvmesh.storage.core.controllers.prefetch_job import PrefetchHandle
from kvmesh.storage.core.controllers.prefetch_types import PrefetchPolicy, PrefetchResult
from kvmesh.storage.core.controllers.store import StoreController, StorePolicy

__all__ = [
    "L2Tier",
    "PrefetchController",
    "PrefetchHandle",
    "PrefetchPolicy",
    "PrefetchResult",
    "StoreController",
    "StorePolicy",
]
