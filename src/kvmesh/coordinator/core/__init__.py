"""The coordinator core: plain typed Python, no protobuf or grpc.

Import :class:`Coordinator` for the whole wired service, or the single
components for tests and other facades.
"""

from .broadcaster import CacheEventBroadcaster, CacheEventConsumer
from .capacity import ServerConfigRegistry
from .coordinator import Coordinator
from .directory import KeyDirectory
from .eviction import DeleteDispatcher, FleetEvictionController
from .gate import Cursor, EventGate
from .keyspace import KeySpaces
from .lru import IsolatedLRU
from .membership import InstanceRegistry, evict_stale
from .persistence import DurableComponent, MetadataStore, PersistenceType
from .pins import PinTable
from .quiesce import QuiesceLock, QuiesceTimeout
from .quotas import QuotaManager
from .settings import CoordinatorSettings
from .status import CoordinatorStatus
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
