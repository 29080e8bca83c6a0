"""The coordinator core: plain typed Python, no protobuf or grpc.

Import :class:`Coordinator` for the whole wired service, or the single
components for tests and other facades.
"""

from .broadcaster import CacheEventBroadcaster, CacheEventConsumer
from .capacity import ServerConfigRegistry
from .coordinator import Coordinator, CoordinatorStatus
from .directory import KeyDirectory
from .eviction import (
    DeleteDispatcher,
    FleetEvictionController,
    IsolatedLRU,
    PinTable,
    QuotaManager,
)
from .gate import Cursor, EventGate, QuiesceLock, QuiesceTimeout
from .keyspace import KeySpaces
from .membership import InstanceRegistry, evict_stale
from .persistence import DurableComponent, MetadataStore, PersistenceType
from .settings import CoordinatorSettings
from .usage import CacheUsageManager, UsageDelta

__all__ = [
    "CacheEventBroadcaster",
    "CacheEventConsumer",
    "CacheUsageManager",
    "Coordinator",
    "CoordinatorSettings",
    "CoordinatorStatus",
    "Cursor",
    "DeleteDispatcher",
    "DurableComponent",
    "EventGate",
    "FleetEvictionController",
    "InstanceRegistry",
    "IsolatedLRU",
    "KeyDirectory",
    "KeySpaces",
    "MetadataStore",
    "PersistenceType",
    "PinTable",
    "QuiesceLock",
    "QuiesceTimeout",
    "QuotaManager",
    "ServerConfigRegistry",
    "UsageDelta",
    "evict_stale",
]
