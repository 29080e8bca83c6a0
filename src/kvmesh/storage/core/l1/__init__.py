"""L1: the node's CPU memory tier (shared-memory pool, allocator, object state machine)."""

from kvmesh.storage.core.l1.allocator import ExtentAllocator
from kvmesh.storage.core.l1.manager import (
    DEFAULT_READ_TTL_S,
    DEFAULT_WRITE_TTL_S,
    STORE_TAG,
    L1Manager,
)
from kvmesh.storage.core.l1.objects import ALIGNMENT, L1Object, ShmLocation, align_up
from kvmesh.storage.core.l1.pool import DEFAULT_SEGMENT_BYTES, DEFAULT_SHM_DIR, L1Pool
from kvmesh.storage.core.l1.results import L1Listener, L1Result, RemovalReason
from kvmesh.storage.core.l1.table import TTLLock

__all__ = [
    "ALIGNMENT",
    "DEFAULT_READ_TTL_S",
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_SHM_DIR",
    "DEFAULT_WRITE_TTL_S",
    "STORE_TAG",
    "ExtentAllocator",
    "L1Listener",
    "L1Manager",
    "L1Object",
    "L1Pool",
    "L1Result",
    "RemovalReason",
    "ShmLocation",
    "TTLLock",
    "align_up",
]
